"""Rank 0 of a gen world: :class:`WorldDriver`, the request front and world-step driver.

Rank 0 is also the leader of CP group 0: its :class:`~helixserve.engine.core.EngineCore` is that
group's. The driver validates each request with that core's rules, assigns it to the
least-loaded CP group (attention DP) and queues it as a command for that group's leader. A world
step broadcasts the plan (every group's commands) to the other leaders (dp > 1; with dp = 1
nothing is sent), runs group 0's :func:`~.leader.leader_step`, and gathers every leader's report
(its updates, each CP rank's cache stats).

Each request's state lives in one :class:`~helixserve.engine.spmd.lifecycle.GenRequestLife`
(awaiting cache -> receiving -> decoding -> finished, see there), moved by the driver's typed
events on the engine thread; the driver keeps only the commands queued for the next plan, each CP
group's load and the causes of failed KV transfers beside it. Transfer outcomes are agreed by the
ranks of each CP group among themselves (:class:`~helixserve.engine.kv_intake.RankTransfers`,
through :mod:`helixserve.transceiver.consensus`); the driver hears the result in the group
leader's updates (first tokens, or a failure with its cause)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from helixserve.engine.core import EngineCore, EngineStats
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spmd.lifecycle import (Aborted, Added, DecodingStarted, Dispatched, Finished,
                                              GenRequestLife, GenState, IllegalTransitionError, Released)
from helixserve.engine.spmd.messages import (
    AbortCommand,
    AddCommand,
    Command,
    ReleaseCommand,
    StepPlan,
    StepReport,
    WorldStoppedError,
    broadcast_plan,
    gather_reports,
)
from helixserve.engine.spmd.executor import SPMDExecutor
from helixserve.engine.spmd.leader import group_stats, leader_step
from helixserve.parallel import ParallelGroups
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class WorldDriver:
    """Rank 0's request front and step driver (an ``EngineCoreLike``; see the module docstring).

    Args:
        core: CP group 0's engine (built with rank 0's ``groups``).
        heartbeat_s: longest idle gap between world steps (default: a quarter of the group timeout).
    """

    max_kept_failures = 4096  # causes of failed transfers nobody asked for (aborted meanwhile)

    def __init__(self, core: EngineCore, heartbeat_s: float | None = None) -> None:
        executor = core.executor
        if not isinstance(executor, SPMDExecutor):
            raise ValueError("the WorldDriver drives a world's EngineCore (built with its groups)")
        self.core = core
        self.groups: ParallelGroups = executor.channel.groups
        self.mapping = self.groups.mapping
        if self.mapping.rank != 0:
            raise ValueError(f"the WorldDriver runs on rank 0, not rank {self.mapping.rank}")
        self.heartbeat_s = heartbeat_s or self.groups.timeout.total_seconds() / 4
        self._pending: list[list[Command]] = [[] for _ in range(self.mapping.dp)]
        self.life = GenRequestLife()  # every request's state (the only record of it)
        self._load: list[int] = [0] * self.mapping.dp  # live tokens budget per CP group
        # every rank's last report (keys fixed here, so other threads may read a copy at any time)
        first = group_stats(core)[0]  # every group starts alike
        self._rank_stats: dict[tuple[int, int], EngineStats] = {
            (d, c): first for d in range(self.mapping.dp) for c in range(self.mapping.cp)}
        self._kv_failures: dict[str, str] = {}  # request id -> its CP group's agreed transfer error
        self._step_id = 0
        self._last_plan = time.monotonic()
        self.failure: str | None = None
        self.is_shut_down = False

    # -- EngineCoreLike

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    hold_cache: bool = False, forced_output_token_ids: Sequence[int] = (),
                    kv_ticket: KVTicket | None = None) -> None:
        """Queue a request on the least-loaded CP group; ``ValueError`` if it could never run.

        ``kv_ticket``: the prompt's KV comes from a ctx worker (passed to every rank's
        ``ShardReceiver.start``); ``forced_output_token_ids`` are then the ctx's first tokens.
        """
        self._check_alive()
        if request_id in self.life:
            raise ValueError(f"request id {request_id!r} is already in the world")
        self.core.check_request(prompt_token_ids, params, forced_output_token_ids, kv_ticket is not None, request_id)
        dp_rank = min(range(self.mapping.dp), key=lambda d: (self._load[d], d))
        cost = len(prompt_token_ids) + params.max_tokens
        self.life.apply(Added(request_id, dp_rank, cost, kv_ticket is not None, hold_cache))
        self._pending[dp_rank].append(AddCommand(request_id, list(prompt_token_ids), params, hold_cache,
                                                 tuple(forced_output_token_ids), kv_ticket))
        self._load[dp_rank] += cost

    def abort(self, request_id: str, error: str | None = None) -> bool:
        entry = self.life.get(request_id)
        if entry is None:
            return False
        self._move(Aborted(request_id))
        self._pending[entry.dp_rank].append(AbortCommand(request_id, error))
        return True

    def release(self, request_id: str) -> bool:
        entry = self.life.get(request_id)
        if entry is None or entry.state is not GenState.HELD:
            return False
        self._move(Released(request_id))
        self._pending[entry.dp_rank].append(ReleaseCommand(request_id))
        return True

    def abort_all(self, error: str) -> list[str]:
        request_ids = self.life.live_ids()
        for rid in request_ids:
            self.abort(rid, error)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        if self.failure is not None or self.is_shut_down:
            return False
        idle_too_long = time.monotonic() - self._last_plan > self.heartbeat_s
        # the leader's overlapped step behind the last token holds that request's cache until read
        return bool(self.life.num_live) or any(self._pending) or idle_too_long or self.core.has_step_in_flight

    def step(self) -> list[RequestUpdate]:
        """One world step; the new tokens of every CP group's requests."""
        self._check_alive()
        plan = StepPlan(self._step_id, self._pending, run_model=bool(self.life.num_live))
        self._pending = [[] for _ in range(self.mapping.dp)]
        for entry in self.life.in_state(GenState.AWAITING_CACHE):  # its AddCommand is in this plan
            self._move(Dispatched(entry.request_id))
        self._step_id += 1
        self._last_plan = time.monotonic()
        try:
            if self.mapping.dp > 1:
                broadcast_plan(plan, self.groups)
            report = leader_step(self.core, plan.commands[0], plan.run_model, self.mapping.dp)
            reports = gather_reports(report, self.groups) if self.mapping.dp > 1 else [report]
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.error("gen world stopped at step %d: %s", plan.step_id, self.failure)
            raise WorldStoppedError(f"the generation world stopped at step {plan.step_id}: {self.failure}") from exc
        assert reports is not None
        return self._absorb(reports)

    def stats(self) -> EngineStats:
        """World totals: request counts summed over DP groups (each CP group's requests are
        replicated on its CP ranks, so its leader's counts), cache blocks and state slots (total
        and used) summed over every rank (each CP rank holds its own share of a request's blocks
        and its own KDA heads' slots). A world with blocks in use on any rank is not idle."""
        s = self.rank_stats()
        leaders = [v for (_, cp_rank), v in s.items() if cp_rank == 0]

        def total(stats: list[EngineStats], name: str) -> int:
            return sum(getattr(g, name) for g in stats)
        return EngineStats(
            *(total(leaders, f) for f in ("num_running", "num_waiting", "num_held")),
            *(total(list(s.values()), f) for f in ("num_blocks", "num_used_blocks", "num_slots", "num_used_slots")))

    def kv_failure(self, request_id: str) -> str | None:
        """Why ``request_id``'s received KV failed (once; the cause its CP group agreed on), or None."""
        return self._kv_failures.pop(request_id, None)

    def rank_stats(self) -> dict[tuple[int, int], EngineStats]:
        """``(dp_rank, cp_rank) -> stats`` each rank reported after the last step (a copy; safe
        to call from another thread)."""
        return dict(self._rank_stats)

    # -- world lifetime

    def shutdown(self) -> None:
        """Tell every rank to leave :func:`serve_rank` (idempotent; skipped after a failure)."""
        if self.is_shut_down or self.failure is not None:
            return
        self.is_shut_down = True
        if self.mapping.dp > 1:
            broadcast_plan(StepPlan(self._step_id, [[] for _ in range(self.mapping.dp)], False, True), self.groups)
        executor = self.core.executor
        assert isinstance(executor, SPMDExecutor)
        executor.shutdown()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorldStoppedError(f"the generation world stopped: {self.failure}")
        if self.is_shut_down:
            raise WorldStoppedError("the generation world was shut down")

    # -- bookkeeping

    def _move(self, event) -> tuple[GenState | None, GenState]:  # noqa: ANN001 (a lifecycle event)
        entry = self.life.get(event.request_id)
        before, after = self.life.apply(event)
        if entry is not None and before is not None and before.is_live and not after.is_live:
            self._load[entry.dp_rank] -= entry.cost
        return before, after

    def _absorb(self, reports: list[StepReport]) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for report in reports:
            for cp_rank, stats in enumerate(report.stats):
                self._rank_stats[(report.dp_rank, cp_rank)] = stats
            for update in report.updates:
                updates.append(self._absorb_update(update))
        return updates

    def _absorb_update(self, update: RequestUpdate) -> RequestUpdate:
        state = self.life.state_of(update.request_id)
        if state is None or not state.is_live:
            return update  # aborted meanwhile: its last tokens still go to the engine front
        if state is GenState.RECEIVING and update.status is RequestStatus.FINISHED_ERROR and update.error:
            # the transfer failed on some rank of the group: kept for kv_failure(); the update
            # goes on without it (a failed transfer is not a failed engine step)
            self._kv_failures[update.request_id] = update.error
            while len(self._kv_failures) > self.max_kept_failures:
                del self._kv_failures[next(iter(self._kv_failures))]
            update = RequestUpdate(update.request_id, update.token_id, update.status)
        if update.is_finished:
            self._move_reported(Finished(update.request_id, keeps_cache=update.status in _HOLDABLE))
        elif state is GenState.RECEIVING:
            self._move_reported(DecodingStarted(update.request_id))
        return update

    def _move_reported(self, event) -> None:  # noqa: ANN001 (a lifecycle event)
        """A move a rank's report asks for; one that contradicts our record is logged, never
        allowed to stop the world."""
        try:
            self._move(event)
        except IllegalTransitionError:
            logger.exception("gen world: a rank's report ignored")


_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
