"""SPMD executor of a helix_a2a generation world: every rank runs every step.

Roles:

- :class:`RankEngine` (every rank): a replica of its CP group's scheduler (CP-group-uniform cache
  accounting, so every rank of the group makes the same decisions), its own cache shard (MLA
  blocks ``b % cp == cp_rank``, KDA state of its heads) and its :class:`HelixKimiForCausalLM`.
- :class:`WorldDriver` (rank 0): the request front, an
  :class:`~helixserve.engine.async_engine.EngineCoreLike`. It validates requests, assigns each to
  the least-loaded CP group (attention DP), and each :meth:`WorldDriver.step` broadcasts one
  :class:`StepPlan` (per-group commands) to the world, runs its own rank's step, and gathers one
  :class:`StepReport` per rank (tokens from the CP leaders, KV arrivals from every rank).
- :func:`serve_rank` (ranks != 0): receive plan -> step -> report, until the shutdown plan.

One world step on every rank::

    plan = broadcast(rank 0's plan)               # gloo control group, with the group timeout
    apply this CP group's commands (add / abort / release / start or fail a received request)
    out = scheduler.schedule()
    out empty -> model.empty_step()               # MoE all-to-alls with 0 rows: nobody waits
    else      -> forward, sample, CP leader's tokens broadcast over the CP group
    updates = scheduler.update_from_output(...)
    gather(report) to rank 0

When no request is live anywhere the plan says so and no rank runs the model. Every collective
has the group timeout, so a dead or stuck rank makes the others raise; a failure on any rank
stops the world (:class:`WorldStoppedError` on rank 0, the rank's process ends elsewhere).
Idle worlds stay alive through heartbeat plans (``has_unfinished_requests`` asks for a step
once ``heartbeat_s`` passed without one).

Requests whose prompt KV arrives from a ctx worker: ``WorldDriver.add_request(..., kv_ticket=T)``
with ``forced_output_token_ids = first_gen_tokens``. Every rank of the chosen CP group allocates
the prompt's cache shard and calls its :class:`KVReceiver`'s ``start(request_id, handle, caches,
T)``; ranks report ``poll()`` results each step; rank 0 starts the request's decode on the whole
group once every rank has its shard (or fails it everywhere when one rank's transfer failed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from helixserve.engine.core import EngineStats
from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.runner import build_forward_batch
from helixserve.engine.sampler import Sampler
from helixserve.engine.scheduler import RequestUpdate, Scheduler
from helixserve.engine.stop import StopChecker
from helixserve.kvcache.manager import CacheHandle, CacheManager
from helixserve.kvcache.pools import reset_slots
from helixserve.models.context import ModelCaches
from helixserve.models.helix import HelixKimiForCausalLM
from helixserve.parallel import CollectiveError, ParallelGroups

logger = logging.getLogger(__name__)


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
        """Transfers finished since the last poll: ``request_id -> None`` (ok) or an error message."""
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


@dataclass(slots=True, frozen=True)
class KVDoneCommand:
    """Every rank of the group has the request's shard (``error`` None): start decoding; else fail."""

    request_id: str
    error: str | None = None


Command = AddCommand | AbortCommand | ReleaseCommand | KVDoneCommand


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
    updates: list[RequestUpdate] = field(default_factory=list)  # CP leaders only
    kv_polls: dict[str, str | None] = field(default_factory=dict)
    stats: EngineStats | None = None  # CP leaders only


def _broadcast_plan(plan: StepPlan | None, groups: ParallelGroups) -> StepPlan:
    box = [plan]
    try:
        dist.broadcast_object_list(box, src=0, group=groups.cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step plan broadcast failed on rank {groups.mapping.rank}: {exc}") from exc
    assert box[0] is not None
    return box[0]


def _gather_reports(report: StepReport, groups: ParallelGroups) -> list[StepReport] | None:
    out: list[Any] | None = [None] * groups.mapping.world_size if groups.mapping.rank == 0 else None
    try:
        dist.gather_object(report, out, dst=0, group=groups.cpu)
    except RuntimeError as exc:
        raise CollectiveError(f"step report gather failed on rank {groups.mapping.rank}: {exc}") from exc
    return out


# ---------------------------------------------------------------- every rank


class RankEngine:
    """One rank's scheduler replica, cache shard, model and sampler (see the module docstring)."""

    def __init__(self, model: HelixKimiForCausalLM, groups: ParallelGroups, caches: ModelCaches,
                 cache_manager: CacheManager, scheduler: Scheduler, seed: int = 0) -> None:
        self.model, self.groups, self.caches = model, groups, caches
        self.mapping = groups.mapping
        self.cache_manager, self.scheduler = cache_manager, scheduler
        self.sampler = Sampler(groups.device, seed=seed)
        self.kv_receiver: KVReceiver | None = None
        self._params: dict[str, SamplingParams] = {}
        self._awaiting_kv: dict[str, Request] = {}  # shard in flight
        self._ready_kv: dict[str, Request] = {}  # shard complete on the whole group, FIFO

    # -- checks rank 0 runs before accepting a request (same rules as EngineCore/Scheduler)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      forced_output_token_ids: Sequence[int] = (), has_kv: bool = False) -> None:
        vocab = self.model.cfg.vocab_size
        bad = [t for t in (*prompt_token_ids, *forced_output_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:8]}")
        if len(forced_output_token_ids) > params.max_tokens:
            raise ValueError(f"{len(forced_output_token_ids)} forced output tokens exceed max_tokens={params.max_tokens}")
        sched = self.scheduler
        num_tokens = len(prompt_token_ids)
        if not 1 <= num_tokens < sched.max_model_len:
            raise ValueError(f"request has {num_tokens} tokens; need 1 <= tokens < max_model_len ({sched.max_model_len})")
        max_cached = min(sched.max_model_len, num_tokens + params.max_tokens) - 1
        if not self.cache_manager.can_ever_fit(max_cached):
            raise ValueError(f"request can need {max_cached} cached tokens; the cache of a CP group holds fewer")
        if params.stop and sched.detokenize is None:
            raise ValueError("request has stop strings but the world has no tokenizer")
        if has_kv and not 1 <= len(forced_output_token_ids) < params.max_tokens:
            raise ValueError(
                f"a request with received KV needs 1 <= len(first_gen_tokens) < max_tokens={params.max_tokens}, "
                f"got {len(forced_output_token_ids)}"
            )

    # -- one step

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepReport:
        report = StepReport(self.mapping.rank, self.mapping.dp_rank)
        report.updates += self._apply(plan.commands[self.mapping.dp_rank])
        if self.kv_receiver is not None and self._awaiting_kv:
            report.kv_polls = self.kv_receiver.poll()
        report.updates += self._start_ready()
        if plan.run_model:
            report.updates += self._run()
        if self.mapping.is_cp_leader:
            report.stats = self.stats()
        else:
            report.updates = []
        return report

    def _run(self) -> list[RequestUpdate]:
        out = self.scheduler.schedule()
        if out.is_empty:
            self.model.empty_step()
            return []
        if out.reset_slot_ids:
            reset_slots(self.caches, out.reset_slot_ids)
        logits = self.model(build_forward_batch(out, self.groups.device), self.caches)
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        tokens = self.sampler(logits, sampled_ids, [self._params[r] for r in sampled_ids]) if sampled_ids else []
        tokens = self._leader_tokens(tokens)
        updates = self.scheduler.update_from_output(out, dict(zip(sampled_ids, tokens, strict=True)))
        self._forget([u.request_id for u in updates if u.is_finished])
        return updates

    def _leader_tokens(self, tokens: list[int]) -> list[int]:
        """Every CP rank sampled from the same logits; the CP leader's tokens are authoritative."""
        if self.mapping.cp == 1 or not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=self.groups.device)
        leader = self.mapping.rank_of(self.mapping.dp_rank, 0)
        try:
            work = dist.broadcast(t, src=leader, group=self.groups.cp, async_op=True)
            work.wait(timeout=self.groups.timeout) if self.groups.backend == "nccl" else work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"sampled-token broadcast failed on rank {self.mapping.rank}: {exc}") from exc
        return t.tolist()

    # -- commands

    def _apply(self, commands: list[Command]) -> list[RequestUpdate]:
        updates = []
        for cmd in commands:
            if isinstance(cmd, AddCommand):
                updates += self._add(cmd)
            elif isinstance(cmd, AbortCommand):
                self._abort(cmd.request_id, cmd.error)
            elif isinstance(cmd, ReleaseCommand):
                self.scheduler.release(cmd.request_id)
            else:
                updates += self._kv_done(cmd)
        return updates

    def _add(self, cmd: AddCommand) -> list[RequestUpdate]:
        request = Request(cmd.request_id, list(cmd.prompt_token_ids), cmd.params,
                          hold_cache_on_finish=cmd.hold_cache,
                          forced_output_token_ids=list(cmd.forced_output_token_ids))
        try:
            if cmd.kv_ticket is None:
                self.scheduler.add_request(request)
            else:
                self._add_awaiting_kv(request, cmd.kv_ticket)
        except ValueError as exc:  # rank 0 checked the same rules: should not happen
            logger.error("rank %d refused request %s: %s", self.mapping.rank, cmd.request_id, exc)
            return [RequestUpdate(cmd.request_id, -1, RequestStatus.FINISHED_ERROR)]
        self._params[cmd.request_id] = cmd.params
        return []

    def _add_awaiting_kv(self, request: Request, ticket: Any) -> None:
        if self.kv_receiver is None:
            raise ValueError("this rank has no KV receiver")
        if not self.cache_manager.can_allocate(request.num_prompt_tokens):
            raise ValueError(f"no cache for the {request.num_prompt_tokens} received prompt tokens")
        handle = self.cache_manager.allocate(request.request_id, request.num_prompt_tokens)
        self._awaiting_kv[request.request_id] = request
        self.kv_receiver.start(request.request_id, handle, self.caches, ticket)

    def _kv_done(self, cmd: KVDoneCommand) -> list[RequestUpdate]:
        request = self._awaiting_kv.pop(cmd.request_id, None)
        if request is None:
            return []
        if cmd.error is not None:  # this rank's transfer, or another rank's, failed
            if self.kv_receiver is not None:
                self.kv_receiver.cancel(request.request_id)  # nothing writes into the handle after this
            self.cache_manager.free(request.request_id)
            self._forget([request.request_id])
            return [RequestUpdate(request.request_id, -1, RequestStatus.FINISHED_ERROR)]
        if request.sampling_params.seed is not None and not request.sampling_params.is_greedy:
            # the draws sampling the first tokens made on the ctx worker (outputs == aggregated run)
            generator = self.sampler._generator(request.request_id, request.sampling_params)  # noqa: SLF001
            for _ in request.forced_output_token_ids:
                torch.empty(self.model.cfg.vocab_size, device=self.groups.device).exponential_(generator=generator)
        self._ready_kv[request.request_id] = request
        return []

    def _start_ready(self) -> list[RequestUpdate]:
        """Received requests start decoding as running slots free up (same order on every CP rank)."""
        updates = []
        while self._ready_kv and self.scheduler.num_running < self.scheduler.max_num_seqs:
            request = self._ready_kv.pop(next(iter(self._ready_kv)))
            updates += _start_prefilled(self.scheduler, request)
        return updates

    def _abort(self, request_id: str, error: str | None) -> None:
        if request_id in self._awaiting_kv or request_id in self._ready_kv:
            if self._awaiting_kv.pop(request_id, None) is not None and self.kv_receiver is not None:
                self.kv_receiver.cancel(request_id)
            self._ready_kv.pop(request_id, None)
            self.cache_manager.free(request_id)
        elif not self.scheduler.abort(request_id, error=error):
            self.scheduler.release(request_id)
        self._forget([request_id])

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._params.pop(rid, None)
        self.sampler.release(request_ids)

    def stats(self) -> EngineStats:
        cache = self.cache_manager.stats()
        num_waiting = self.scheduler.num_waiting + len(self._awaiting_kv) + len(self._ready_kv)
        return EngineStats(self.scheduler.num_running, num_waiting,
                           self.scheduler.num_held, cache.num_blocks, cache.num_used_blocks, cache.num_slots,
                           cache.num_used_slots)


def _start_prefilled(scheduler: Scheduler, request: Request) -> list[RequestUpdate]:
    """Put a request whose prompt is in the cache (received) into ``scheduler.running``, decoding
    from its forced first tokens; returns their updates. Uses ``Scheduler.add_prefilled`` where
    the scheduler has it; otherwise sets the few fields that admission would."""
    if hasattr(scheduler, "add_prefilled"):
        return scheduler.add_prefilled(request)
    request.output_token_ids = list(request.forced_output_token_ids)
    request.num_computed_tokens = request.num_prompt_tokens + len(request.output_token_ids) - 1
    request.status = RequestStatus.RUNNING
    scheduler._requests[request.request_id] = request  # noqa: SLF001 - see the docstring
    scheduler.running.append(request)
    if request.sampling_params.stop and scheduler.detokenize is not None:
        scheduler._stop_checkers[request.request_id] = StopChecker(request.sampling_params.stop, scheduler.detokenize)  # noqa: SLF001
    return [RequestUpdate(request.request_id, t, RequestStatus.RUNNING) for t in request.output_token_ids]


def serve_rank(rank: RankEngine) -> int:
    """Worker loop of a rank != 0: run every plan until the shutdown plan; returns the step count.

    Raises on any failure (a collective timed out, the model raised): the caller should let the
    process end so the other ranks' collectives fail fast.
    """
    steps = 0
    while True:
        plan = _broadcast_plan(None, rank.groups)
        if plan.shutdown:
            return steps
        _gather_reports(rank.step(plan), rank.groups)
        steps += 1


# ---------------------------------------------------------------- rank 0


class WorldDriver:
    """Rank 0's request front and step driver (an ``EngineCoreLike``; see the module docstring).

    Args:
        rank: rank 0's :class:`RankEngine`.
        heartbeat_s: longest idle gap between plans (default: a quarter of the group timeout).
    """

    def __init__(self, rank: RankEngine, heartbeat_s: float | None = None) -> None:
        if rank.mapping.rank != 0:
            raise ValueError(f"the WorldDriver runs on rank 0, not rank {rank.mapping.rank}")
        self.rank = rank
        self.mapping = rank.mapping
        self.heartbeat_s = heartbeat_s or rank.groups.timeout.total_seconds() / 4
        self._pending: list[list[Command]] = [[] for _ in range(self.mapping.dp)]
        self._owner: dict[str, int] = {}  # live request -> dp_rank
        self._held: dict[str, int] = {}  # finished hold_cache requests -> dp_rank, until release()
        self._holdable: set[str] = set()
        self._load: list[int] = [0] * self.mapping.dp  # live tokens budget per CP group
        self._cost: dict[str, int] = {}
        self._kv_polls: dict[str, dict[int, str | None]] = {}  # awaiting request -> rank -> result
        self._group_stats: list[EngineStats] = [rank.stats()] * self.mapping.dp
        self._step_id = 0
        self._last_plan = time.monotonic()
        self.failure: str | None = None
        self.is_shut_down = False

    # -- EngineCoreLike

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    hold_cache: bool = False, forced_output_token_ids: Sequence[int] = (),
                    kv_ticket: Any = None) -> None:
        """Queue a request on the least-loaded CP group; ``ValueError`` if it could never run.

        ``kv_ticket``: the prompt's KV comes from a ctx worker (passed to every rank's
        ``KVReceiver.start``); ``forced_output_token_ids`` are then the ctx's first tokens.
        """
        self._check_alive()
        if request_id in self._owner or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in the world")
        self.rank.check_request(prompt_token_ids, params, forced_output_token_ids, has_kv=kv_ticket is not None)
        dp_rank = min(range(self.mapping.dp), key=lambda d: (self._load[d], d))
        self._pending[dp_rank].append(AddCommand(request_id, list(prompt_token_ids), params, hold_cache,
                                                 tuple(forced_output_token_ids), kv_ticket))
        self._owner[request_id] = dp_rank
        self._cost[request_id] = len(prompt_token_ids) + params.max_tokens
        self._load[dp_rank] += self._cost[request_id]
        if kv_ticket is not None:
            self._kv_polls[request_id] = {}
        if hold_cache:
            self._holdable.add(request_id)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        dp_rank = self._owner.get(request_id)
        if dp_rank is None:
            dp_rank = self._held.pop(request_id, None)
            if dp_rank is None:
                return False
        else:
            self._finish(request_id)
        self._pending[dp_rank].append(AbortCommand(request_id, error))
        return True

    def release(self, request_id: str) -> bool:
        dp_rank = self._held.pop(request_id, None)
        if dp_rank is None:
            return False
        self._pending[dp_rank].append(ReleaseCommand(request_id))
        return True

    def abort_all(self, error: str) -> list[str]:
        request_ids = list(self._owner)
        for rid in request_ids:
            self.abort(rid, error)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        if self.failure is not None or self.is_shut_down:
            return False
        idle_too_long = time.monotonic() - self._last_plan > self.heartbeat_s
        return bool(self._owner) or any(self._pending) or idle_too_long

    def step(self) -> list[RequestUpdate]:
        """One world step; the new tokens of every CP group's requests."""
        self._check_alive()
        plan = StepPlan(self._step_id, self._pending, run_model=bool(self._owner))
        self._pending = [[] for _ in range(self.mapping.dp)]
        self._add_kv_decisions(plan)
        self._step_id += 1
        self._last_plan = time.monotonic()
        try:
            _broadcast_plan(plan, self.rank.groups)
            reports = _gather_reports(self.rank.step(plan), self.rank.groups)
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.error("gen world stopped at step %d: %s", plan.step_id, self.failure)
            raise WorldStoppedError(f"the generation world stopped at step {plan.step_id}: {self.failure}") from exc
        assert reports is not None
        return self._absorb(reports)

    def stats(self) -> EngineStats:
        s = self._group_stats
        return EngineStats(*(sum(getattr(g, f) for g in s) for f in EngineStats.__dataclass_fields__))

    # -- world lifetime

    def shutdown(self) -> None:
        """Tell every rank to leave :func:`serve_rank` (idempotent; skipped after a failure)."""
        if self.is_shut_down or self.failure is not None:
            return
        self.is_shut_down = True
        _broadcast_plan(StepPlan(self._step_id, [[] for _ in range(self.mapping.dp)], False, True), self.rank.groups)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorldStoppedError(f"the generation world stopped: {self.failure}")
        if self.is_shut_down:
            raise WorldStoppedError("the generation world was shut down")

    # -- bookkeeping

    def _finish(self, request_id: str, is_held: bool = False) -> None:
        dp_rank = self._owner.pop(request_id)
        self._load[dp_rank] -= self._cost.pop(request_id)
        self._kv_polls.pop(request_id, None)
        if request_id in self._holdable:
            self._holdable.discard(request_id)
            if is_held:
                self._held[request_id] = dp_rank

    def _add_kv_decisions(self, plan: StepPlan) -> None:
        """Start (or fail) received requests whose every rank reported its transfer."""
        cp = self.mapping.cp
        for rid, polls in list(self._kv_polls.items()):
            errors = [e for e in polls.values() if e is not None]
            if errors or len(polls) == cp:
                plan.commands[self._owner[rid]].append(KVDoneCommand(rid, "; ".join(errors) or None))
                del self._kv_polls[rid]
                plan.run_model = True

    def _absorb(self, reports: list[StepReport]) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for report in reports:
            for rid, result in report.kv_polls.items():
                if rid in self._kv_polls:
                    self._kv_polls[rid][report.rank] = result
            if report.stats is not None:
                self._group_stats[report.dp_rank] = report.stats
            for update in report.updates:
                updates.append(update)
                if update.is_finished and update.request_id in self._owner:
                    self._finish(update.request_id, is_held=update.status in _HOLDABLE)
        return updates


_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
