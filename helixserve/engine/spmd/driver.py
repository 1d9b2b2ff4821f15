"""Rank 0 of a gen world: :class:`WorldDriver`, the request front and step driver."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from helixserve.engine.core import EngineStats
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spmd.messages import (
    AbortCommand,
    AddCommand,
    Command,
    KVDoneCommand,
    ReleaseCommand,
    StepPlan,
    StepReport,
    WorldStoppedError,
    broadcast_plan,
    gather_reports,
)
from helixserve.engine.spmd.rank import RankEngine

logger = logging.getLogger(__name__)



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
        # every rank's last report (keys fixed here, so other threads may read a copy at any time)
        self._rank_stats: dict[tuple[int, int], EngineStats] = {
            (d, c): rank.stats() for d in range(self.mapping.dp) for c in range(self.mapping.cp)}
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
            broadcast_plan(plan, self.rank.groups)
            reports = gather_reports(self.rank.step(plan), self.rank.groups)
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
        broadcast_plan(StepPlan(self._step_id, [[] for _ in range(self.mapping.dp)], False, True), self.rank.groups)

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
                self._rank_stats[(report.dp_rank, report.cp_rank)] = report.stats
            for update in report.updates:
                updates.append(update)
                if update.is_finished and update.request_id in self._owner:
                    self._finish(update.request_id, is_held=update.status in _HOLDABLE)
        return updates


_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
