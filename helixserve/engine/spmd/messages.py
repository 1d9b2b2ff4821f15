"""What rank 0 and the other ranks of a gen world exchange each step (pickled over the gloo
control group), the KV-receiver seam, and the world's failure error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from helixserve.cache_layout import ModelCaches
from helixserve.engine.core import EngineStats
from helixserve.engine.request import SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.kvcache.manager import CacheHandle
from helixserve.parallel import CollectiveError, ParallelGroups


class WorldStoppedError(ValueError):
    """The generation world failed (a rank raised, died or timed out) and no longer runs.

    A ``ValueError`` so that an :class:`~helixserve.engine.async_engine.AsyncEngine` refuses new
    requests with an error instead of losing them; the server should stop (and restart the world).
    """


class KVReceiver(Protocol):
    """One rank's receiver of ctx-prefilled shards (the transceiver plugs in here).

    ``start`` must fill exactly this rank's shard: the blocks of ``handle.block_ids`` (global
    logical blocks ``cp_rank + k * cp``) in every MLA pool of ``caches``, and slot ``handle.slot``
    of every KDA state / conv pool (this rank's heads, ``[q | k | v]`` conv sections).
    """

    def start(self, request_id: str, handle: CacheHandle, caches: ModelCaches, ticket: Any) -> None: ...
    def poll(self) -> dict[str, str | None]:
        """Transfers finished since the last poll: ``request_id -> None`` (ok) or an error message.
        Local and bounded (no collective): the rank agrees on the outcomes with its CP group
        through :class:`~helixserve.transceiver.consensus.TransferConsensus`."""
    def cancel(self, request_id: str) -> None: ...


# ---------------------------------------------------------------- messages (pickled, gloo)


@dataclass(slots=True, frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_cache: bool = False
    forced_output_token_ids: tuple[int, ...] = ()
    kv_ticket: Any = None  # set: the prompt's KV arrives through the ranks' KVReceiver


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
    run_model: bool = True  # False: no request is live anywhere (heartbeat / cleanup)
    shutdown: bool = False


@dataclass(slots=True)
class StepReport:
    rank: int
    dp_rank: int
    cp_rank: int = 0
    updates: list[RequestUpdate] = field(default_factory=list)  # CP leaders only
    stats: EngineStats | None = None  # every rank: its own cache shard's blocks and slots


def broadcast_plan(plan: StepPlan | None, groups: ParallelGroups) -> StepPlan:
    box = [plan]
    try:
        dist.broadcast_object_list(box, src=0, group=groups.cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step plan broadcast failed on rank {groups.mapping.rank}: {exc}") from exc
    assert box[0] is not None
    return box[0]


def gather_reports(report: StepReport, groups: ParallelGroups) -> list[StepReport] | None:
    out: list[Any] | None = [None] * groups.mapping.world_size if groups.mapping.rank == 0 else None
    try:
        dist.gather_object(report, out, dst=0, group=groups.cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step report gather failed on rank {groups.mapping.rank}: {exc}") from exc
    return out
