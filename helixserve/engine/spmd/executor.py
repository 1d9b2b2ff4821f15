"""The leader's executor of a CP group: every step goes to the group's ranks, then runs here.

:class:`SPMDExecutor` is what a world's :class:`~helixserve.engine.core.EngineCore` launches
steps through (the single-process engine launches on its :class:`ModelRunner` directly): each
:meth:`launch` first sends every other rank of the CP group its own copy of the step (its block
tables, :func:`~.channel.output_for_rank`), then runs the leader's ``ModelRunner`` (the same
forward on every rank: helix collectives inside the model pair the ranks up), samples on the
leader and broadcasts the tokens over the group, so every rank has them on its device for an
overlapped next step. A failed sampling still broadcasts (``-1`` tokens) before it raises, so
no rank is left waiting. With ``cp == 1`` nothing is sent.

It also carries the group's other messages: KV reception starts / cancels / agreement
(:meth:`transfers`), the empty step an idle DP group runs for the MoE all-to-alls
(:meth:`idle_step`), heartbeats and shutdown. ``num_forwards`` counts model forwards (real or
empty), so the world can keep every DP group at one forward per world step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from helixserve.engine.request import SamplingParams
from helixserve.engine.runner import LaunchedStep, ModelRunner
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.engine.spmd.channel import (GroupChannel, Heartbeat, Idle, Launch, Shutdown, Transfers,
                                            output_for_rank)
from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.parallel import CollectiveError
from helixserve.transceiver.ticket import KVTicket


class SPMDExecutor:
    """Leader side of a CP group's steps (see the module docstring)."""

    def __init__(self, runner: ModelRunner, cache: GroupCacheManager, channel: GroupChannel) -> None:
        self.runner, self.cache, self.channel = runner, cache, channel
        self.cp = channel.mapping.cp
        self.world_size = channel.mapping.world_size
        self.num_forwards = 0
        self.num_messages = 0

    # the ModelRunner interface EngineCore uses
    @property
    def sampler(self):  # noqa: ANN201 - the runner's Sampler
        return self.runner.sampler

    @property
    def decode_graphs(self):  # noqa: ANN201
        return self.runner.decode_graphs

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def launch(self, out: SchedulerOutput, params: Mapping[str, SamplingParams],
               input_tokens: torch.Tensor | None = None) -> LaunchedStep:
        if out.is_empty:
            return self.runner.launch(out, params)
        # the step is prepared (each request's sampling, the batch) before anything is sent: one
        # that cannot be (StepPreparationError) fails on this leader alone, the ranks never saw
        # it, and the core runs it again without the requests it is traced to. A captured decode
        # step (static helix step) replays on every rank of the group (the followers'
        # runner.forward decides alike).
        prepared = self.runner.prepare_step(out, params, input_tokens)
        self.num_forwards += 1
        if self.world_size == 1:
            logits = self.runner.run_step(out, prepared, input_tokens)
        else:
            self._send_launch(out, input_tokens)
            try:
                logits = self.runner.run_step(out, prepared, input_tokens)
            except Exception as exc:  # the ranks' collectives are unmatched now
                raise CollectiveError(f"forward failed on rank {self.channel.mapping.rank}: "
                                      f"{type(exc).__name__}: {exc}") from exc
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        if not sampled_ids:
            return LaunchedStep([], None, None, None)
        try:
            tokens = self.runner.sampler.launch(logits, sampled_ids, [params[r] for r in sampled_ids])
        except Exception:
            self.channel.broadcast_tokens(torch.full((len(sampled_ids),), -1, dtype=torch.int64, device=self.device))
            raise
        return self.runner.launched(sampled_ids, self.channel.broadcast_tokens(tokens))

    def _send_launch(self, out: SchedulerOutput, input_tokens: torch.Tensor | None) -> None:
        if not self.channel.is_alone:
            use_previous = input_tokens is not None
            self._send([None] + [Launch(output_for_rank(out, self.cache, r), use_previous) for r in range(1, self.cp)])

    def idle_step(self) -> None:
        """An idle DP group's step: the MoE all-to-alls with no rows, on every rank of the group."""
        self._send_all(Idle())
        self.num_forwards += 1
        try:
            self.runner.model.empty_step()
        except Exception as exc:
            raise CollectiveError(f"empty step failed on rank {self.channel.mapping.rank}: {exc}") from exc

    def transfers(self, starts: list[tuple[str, KVTicket]], cancels: list[str], agree: bool, wait: bool) -> None:
        """Tell the other ranks which receptions to start (each its own handle) and cancel,
        whether to agree on the outcomes now, and whether their polls may wait first."""
        if self.channel.is_alone:
            return
        self._send([None] + [Transfers([(rid, self.cache.handle_on(r, rid), ticket) for rid, ticket in starts],
                                       list(cancels), agree, wait) for r in range(1, self.cp)])

    def heartbeat(self) -> None:
        self._send_all(Heartbeat())

    def shutdown(self) -> None:
        self._send_all(Shutdown())

    def _send_all(self, message: Any) -> None:
        if not self.channel.is_alone:
            self._send([message] * self.cp)

    def _send(self, messages: list[Any]) -> None:
        self.num_messages += 1
        self.channel.send(messages)
