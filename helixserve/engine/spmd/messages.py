"""What rank 0 and the other CP groups' leaders of a gen world exchange each world step (pickled
over the leaders' gloo group; with dp = 1 nothing is exchanged), and the world's failure error.
What a leader sends its own group's ranks is in :mod:`.channel`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from helixserve.engine.core import EngineStats
from helixserve.engine.request import SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spec.stats import SpecDecodeStats
from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot
from helixserve.parallel import CollectiveError, ParallelGroups
from helixserve.transceiver.ticket import KVTicket


class WorldStoppedError(ValueError):
    """The generation world failed (a rank raised, died or timed out) and no longer runs.

    A ``ValueError`` so that an :class:`~helixserve.engine.async_engine.AsyncEngine` refuses new
    requests with an error instead of losing them; the server should stop (and restart the world).
    """


# ---------------------------------------------------------------- messages (pickled, gloo)


@dataclass(slots=True, frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_cache: bool = False
    forced_output_token_ids: tuple[int, ...] = ()
    kv_ticket: KVTicket | None = None  # set: the prompt's KV arrives through the ranks' ShardReceiver


@dataclass(slots=True, frozen=True)
class AbortCommand:
    request_id: str
    error: str | None = None


@dataclass(slots=True, frozen=True)
class ReleaseCommand:
    request_id: str


Command = AddCommand | AbortCommand | ReleaseCommand


@dataclass(slots=True)
class StepPlan:
    step_id: int
    commands: list[list[Command]]  # per dp_rank
    run_model: bool = True  # every group runs a forward (or its empty step); False: none is live
    shutdown: bool = False


@dataclass(slots=True)
class StepReport:
    rank: int
    dp_rank: int
    cp_rank: int = 0
    updates: list[RequestUpdate] = field(default_factory=list)
    stats: list[EngineStats] = field(default_factory=list)  # per CP rank of the group: its own blocks and slots
    spec_stats: SpecDecodeStats | None = None  # the group's speculative decoding counts (None: off)
    prefix_stats: PrefixCacheSnapshot | None = None  # the group's prefix cache (None: caching off)


def broadcast_plan(plan: StepPlan | None, groups: ParallelGroups) -> StepPlan:
    """Rank 0's plan to every CP leader (called by the leaders only)."""
    box = [plan]
    try:
        dist.broadcast_object_list(box, src=0, group=groups.leaders_cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step plan broadcast failed on rank {groups.mapping.rank}: {exc}") from exc
    assert box[0] is not None
    return box[0]


def gather_reports(report: StepReport, groups: ParallelGroups) -> list[StepReport] | None:
    """Every CP leader's report to rank 0 (called by the leaders only)."""
    out: list[Any] | None = [None] * groups.mapping.dp if groups.mapping.rank == 0 else None
    try:
        dist.gather_object(report, out, dst=0, group=groups.leaders_cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step report gather failed on rank {groups.mapping.rank}: {exc}") from exc
    return out
