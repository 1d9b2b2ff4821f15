"""What a CP group's leader sends the other ranks of its group, and how.

The leader runs the group's only scheduler; the other ranks (followers) hold their cache shard,
model shard and ``ModelRunner`` and do what each message says, in order (:mod:`.follower`):

- :class:`Launch`: run this step (the ``SchedulerOutput`` with *this rank's* block tables); with
  ``use_previous_tokens`` its input ids are the previous step's sampled tokens (overlapped
  decoding); then receive the leader's sampled tokens (``broadcast_tokens``). A verify step
  (speculative decoding: rows with drafts) receives no tokens: the leader alone verifies the
  drafts and decides what each run keeps; ``rollback`` carries that decision for the previous
  verify step (index into its speculating sequences -> rows kept), applied to this rank's KDA
  head slice before the step runs (every rank rolls back the same rows).
- :class:`Rollback`: the same decision alone, when the leader's next message is not a launch; it
  rolls a heads-TP draft model's KDA heads back too (the same rows).
- :class:`Draft`: run a heads-TP drafter's forwards with the leader (its all-reduces pair the
  ranks up), before the step's launch: a draft model's step (a
  :class:`~helixserve.engine.draft_runner.DraftPlan`) or received prompt's rows, a hidden
  drafter's step, received prompt or held prefills (:mod:`helixserve.engine.hidden_work`).
- :class:`Idle`: join the MoE all-to-alls with no rows (another DP group runs a step).
- :class:`Transfers`: start / cancel KV receptions into the handles given, then, with
  ``agree``, poll the receiver and agree on the outcomes (the transceiver consensus).
- :class:`Holds`: a ctx world's held prefills (:mod:`helixserve.engine.kv_holds`): hold each
  on this rank's KV sender (this rank's handle), cancel, then, with ``agree``, agree with the
  group on the holds every rank freed.
- :class:`Heartbeat`: nothing (an idle world stays inside the collective timeout).
- :class:`Shutdown`: leave the loop.

Messages go over the group's gloo group (``ParallelGroups.cp_cpu``) with ``scatter_object_list``
(each rank its own tables), the sampled tokens over the group's device group (``cp``: NCCL on
GPUs, on the stream, no host sync). With ``cp == 1`` nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from helixserve.engine.model_drafters import ModelDrafterWork
from helixserve.engine.kv_holds import HoldStart
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.kvcache.manager import CacheHandle
from helixserve.parallel import CollectiveError, ParallelGroups
from helixserve.transceiver.ticket import KVTicket


@dataclass(slots=True)
class Launch:
    out: SchedulerOutput
    use_previous_tokens: bool = False
    rollback: dict[int, int] | None = None  # the previous verify step's kept rows (see the module docstring)


@dataclass(slots=True)
class Rollback:
    keep: dict[int, int]


@dataclass(slots=True)
class Draft:
    work: ModelDrafterWork


@dataclass(slots=True)
class Idle:
    pass


@dataclass(slots=True)
class Transfers:
    starts: list[tuple[str, CacheHandle, KVTicket]] = field(default_factory=list)  # (request id, handle, ticket)
    cancels: list[str] = field(default_factory=list)
    agree: bool = False
    wait: bool = False  # the leader's poll may wait (nothing else to run): the others' may too


@dataclass(slots=True)
class Holds:
    starts: list[HoldStart] = field(default_factory=list)  # this rank's handles
    cancels: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    agree: bool = False


@dataclass(slots=True)
class Heartbeat:
    pass


@dataclass(slots=True)
class Shutdown:
    pass


Message = Launch | Rollback | Draft | Idle | Transfers | Holds | Heartbeat | Shutdown


def output_for_rank(out: SchedulerOutput, cache: GroupCacheManager, cp_rank: int) -> SchedulerOutput:
    """``out`` with CP rank ``cp_rank``'s block tables (same sequences, slots, tokens, drafts and
    state checkpoint slots)."""
    seqs = [ScheduledSeq(s.request_id, s.token_ids, s.context_len,
                         cache.handle_on(cp_rank, s.request_id).block_table(), s.slot, s.is_prefill, s.sample,
                         s.num_draft_tokens, s.restore_checkpoint, s.save_checkpoint, s.inner_saves)
            for s in out.seqs]
    return SchedulerOutput(seqs=seqs, preempted_ids=out.preempted_ids)


class GroupChannel:
    """One rank's end of its CP group's message stream (see the module docstring)."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.mapping = groups.mapping
        self.leader = self.mapping.rank_of(self.mapping.dp_rank, 0)
        self.is_leader = self.mapping.cp_rank == 0
        self.is_alone = self.mapping.cp == 1

    def send(self, messages: list[Message]) -> None:
        """Leader: ``messages[r]`` to CP rank ``r`` (``messages[0]`` is the leader's own, unused)."""
        if self.is_alone:
            return
        try:
            dist.scatter_object_list([None], messages, src=self.leader, group=self.groups.cp_cpu)
        except RuntimeError as exc:
            raise CollectiveError(f"step message to CP group failed on rank {self.mapping.rank}: {exc}") from exc

    def send_all(self, message: Message) -> None:
        self.send([message] * self.mapping.cp)

    def receive(self) -> Message:
        """Follower: the leader's next message."""
        box: list[Any] = [None]
        try:
            dist.scatter_object_list(box, None, src=self.leader, group=self.groups.cp_cpu)
        except RuntimeError as exc:
            raise CollectiveError(f"step message receive failed on rank {self.mapping.rank}: {exc}") from exc
        return box[0]

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The leader's sampled tokens to every rank of the group (in place on followers)."""
        if self.is_alone or tokens.numel() == 0:
            return tokens
        try:
            dist.broadcast(tokens, src=self.leader, group=self.groups.cp)
        except RuntimeError as exc:
            raise CollectiveError(f"sampled-token broadcast failed on rank {self.mapping.rank}: {exc}") from exc
        return tokens
