"""A CP group's leader end of its channel: :class:`GroupLeader`.

A world's :class:`~helixserve.engine.core.EngineCore` (on each CP group's leader) launches a step
on its own ``ModelRunner`` after :meth:`GroupLeader.send_launch` sent every other rank of the
group its own copy of the step (its block tables, :func:`~.channel.output_for_rank`); the same
forward runs on every rank (helix collectives inside the model pair the ranks up), the leader
samples and broadcasts the tokens (:meth:`GroupLeader.sample`) over the group, so every rank
has them on its device for an overlapped next step. A failed sampling still broadcasts (``-1``
tokens) before it raises, so no rank is left waiting. With ``cp == 1`` nothing is sent.

A verify step (speculative decoding) is verified on the leader alone: no tokens are broadcast
(no step overlaps a verify step). The leader rolls its KDA head slice back at once and the rows
each speculating sequence keeps (:meth:`GroupLeader.share_rollback`) go to the other ranks with
the next launch (or alone, ahead of any other message), so every rank rolls back the same rows
before it runs anything else on those slots.

A heads-TP drafter (``speculative.draft_tensor_parallel_size``: a draft model or a hidden
drafter) runs on every rank: before the drafter forwards of a step (or of a received prompt, or
of held prefills) the leader sends the group their work (:meth:`GroupLeader.send_draft`), after
any pending rollback, which rolls a draft model back too.

It also carries the group's other messages: KV reception starts / cancels / agreement
(:meth:`transfers`), the empty step an idle DP group runs for the MoE all-to-alls
(:meth:`idle_step`), heartbeats and shutdown. ``num_forwards`` counts model forwards (real or
empty) and ``num_messages`` the messages sent, so the world step can keep every DP group at one
forward per world step and every rank's wait bounded (:meth:`keep_in_step`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from helixserve.engine.request import SamplingParams
from helixserve.engine.runner import LaunchedStep, ModelRunner
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.engine.kv_holds import HoldStart
from helixserve.engine.model_drafters import ModelDrafterWork
from helixserve.engine.spmd.channel import (Draft, GroupChannel, Heartbeat, Holds, Idle, Launch, Rollback, Shutdown,
                                            Transfers, output_for_rank)
from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.parallel import CollectiveError
from helixserve.transceiver.ticket import KVTicket


class GroupLeader:
    """The leader's side of a CP group's messages (see the module docstring)."""

    def __init__(self, runner: ModelRunner, cache: GroupCacheManager, channel: GroupChannel) -> None:
        self.runner, self.cache, self.channel = runner, cache, channel
        self.cp = channel.mapping.cp
        self.world_size = channel.mapping.world_size
        self.num_forwards = 0
        self.num_messages = 0
        self._rollback: dict[int, int] | None = None  # the last verify step's kept rows, not yet sent

    def send_launch(self, out: SchedulerOutput, input_tokens: torch.Tensor | None) -> None:
        """Every other rank of the group runs ``out`` (its own block tables) with the leader, after
        rolling back the last verify step's rejected rows (:meth:`share_rollback`)."""
        self.num_forwards += 1
        if not self.channel.is_alone:
            use_previous = input_tokens is not None
            keep, self._rollback = self._rollback, None
            self._send([None] + [Launch(output_for_rank(out, self.cache, r), use_previous, keep)
                                 for r in range(1, self.cp)])

    def send_draft(self, work: ModelDrafterWork) -> None:
        """Every other rank of the group runs a heads-TP drafter's ``work`` with the leader
        (after the last verify step's rollback, which rolls a draft model back too)."""
        self._send_all(Draft(work))

    def share_rollback(self, keep: dict[int, int]) -> None:
        """The other ranks roll the last verify step's sequences back to ``keep`` (index into its
        speculating sequences -> rows kept) before their next step or message."""
        assert self._rollback is None, "a verify step's rollback was not sent before the next step"
        if keep and not self.channel.is_alone:
            self._rollback = keep

    def sample(self, out: SchedulerOutput, logits: torch.Tensor, params: Mapping[str, SamplingParams]) -> LaunchedStep:
        """Sample ``out``'s sampled rows on the leader and broadcast the tokens over the group; a
        sampling that raises still broadcasts (``-1`` tokens) first, so no rank is left waiting."""
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        if not sampled_ids:  # only unsampled prompt chunks: the caches were written, nothing to draw
            return LaunchedStep([], None, None, None)
        if out.num_draft_tokens:  # a verify step: the leader alone decides (module docstring)
            return self.runner.sample(out, logits, params)
        try:
            tokens = self.runner.sampler.launch(logits, sampled_ids, [params[r] for r in sampled_ids])
        except Exception:
            self.channel.broadcast_tokens(torch.full((len(sampled_ids),), -1, dtype=torch.int64,
                                                     device=self.runner.device))
            raise
        return self.runner.launched(sampled_ids, self.channel.broadcast_tokens(tokens))

    def idle_step(self) -> None:
        """An idle DP group's step: the MoE all-to-alls with no rows, on every rank of the group."""
        self._send_all(Idle())
        self.num_forwards += 1
        try:
            self.runner.model.empty_step()
        except Exception as exc:
            raise CollectiveError(f"empty step failed on rank {self.channel.mapping.rank}: {exc}") from exc

    def keep_in_step(self, needs_forward: bool, num_forwards: int, num_messages: int) -> None:
        """After a world step that began at these counts: the idle step when the step ran no
        forward and needs one (dp > 1 with a request live in the world), a heartbeat when nothing
        was sent to the group."""
        if needs_forward and self.num_forwards == num_forwards:
            self.idle_step()
        if self.num_messages == num_messages:
            self.heartbeat()

    def transfers(self, starts: list[tuple[str, KVTicket]], cancels: list[str], agree: bool, wait: bool) -> None:
        """Tell the other ranks which receptions to start (each its own handle) and cancel,
        whether to agree on the outcomes now, and whether their polls may wait first."""
        if self.channel.is_alone:
            return
        self._send([None] + [Transfers([(rid, self.cache.handle_on(r, rid), ticket) for rid, ticket in starts],
                                       list(cancels), agree, wait) for r in range(1, self.cp)])

    def holds(self, starts: list[list[HoldStart]], cancels: list[tuple[str, str]], agree: bool) -> None:
        """A ctx world's holds: ``starts[r]`` for rank ``r`` (its own handles), the cancels, and
        whether to agree on the freed holds now (:mod:`helixserve.engine.kv_holds`)."""
        if not self.channel.is_alone:
            self._send([None] + [Holds(starts[r], list(cancels), agree) for r in range(1, self.cp)])

    def heartbeat(self) -> None:
        self._send_all(Heartbeat())

    def shutdown(self) -> None:
        self._send_all(Shutdown())

    def _send_all(self, message: Any) -> None:
        if not self.channel.is_alone:
            self._send([message] * self.cp)

    def _send(self, messages: list[Any]) -> None:
        if self._rollback is not None:  # any message after a verify step: its rollback first
            keep, self._rollback = self._rollback, None
            self._send([Rollback(keep)] * self.cp)
        self.num_messages += 1
        self.channel.send(messages)
