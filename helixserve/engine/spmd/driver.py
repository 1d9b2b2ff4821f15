"""The one engine driver: :class:`WorldDriver`, the step loop of every engine a server or the
Python API runs, a gen world's (dp x cp ranks), a ctx worker's or a single process's (a world of
one: its ``EngineCore`` built without groups).

A world step (:meth:`WorldDriver.step`) on a CP group's leader::

    plan      rank 0: the commands queued since the last step (add / abort / release, each for
              the CP group the request was assigned to), broadcast to the other leaders (dp > 1);
              another leader: receives it
    apply     this group's commands to its EngineCore
    step      EngineCore.step(): KV intake, schedule -> launch -> postprocess (the group's
              other ranks run each launch with it, see :mod:`.leader`)
    in step   dp > 1 and nothing launched: the idle step; nothing sent to the group: a heartbeat
    report    every leader's updates and each CP rank's cache stats (and, speculating, its
              group's draft counts) gathered on rank 0 (dp > 1)

Rank 0 is also the world's front: it validates each request with its core's rules, assigns it
to the least-loaded CP group (attention DP) and keeps each request's state in one
:class:`~helixserve.engine.spmd.lifecycle.GenRequestLife` (awaiting cache -> receiving ->
decoding -> finished), moved by typed events on the engine thread; beside it only the commands
queued for the next plan, each CP group's load and the causes of failed KV transfers. Transfer
outcomes are agreed by the ranks of each CP group among themselves
(:class:`~helixserve.engine.kv_intake.RankTransfers`, through
:mod:`helixserve.transceiver.consensus`); the driver hears the result in the group leader's
updates. Another leader runs :func:`serve_leader` (its driver's steps until the shutdown plan).

:func:`drive_to_completion` is the one offline loop (``LLM.generate`` and ``generate --dp --cp``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from helixserve.engine.core import EngineCore, EngineStats
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spec.stats import SpecDecodeStats
from helixserve.engine.stop import truncate_at_stop
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
from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.parallel import Mapping, ParallelGroups
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationResult:
    """One prompt's result from the offline loop (:func:`drive_to_completion`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None  # why the engine failed this request (finish_reason "error")


class WorldDriver:
    """A CP group leader's engine driver, rank 0's the world's request front (an
    ``EngineCoreLike``; see the module docstring).

    Args:
        core: this leader's group's engine (built with the rank's ``groups``; without: a world of one).
        heartbeat_s: longest idle gap between world steps (default: a quarter of the group timeout).
    """

    max_kept_failures = 4096  # causes of failed transfers nobody asked for (aborted meanwhile)

    def __init__(self, core: EngineCore, heartbeat_s: float | None = None) -> None:
        self.core = core
        self.groups: ParallelGroups | None = core.group.channel.groups if core.group is not None else None
        self.mapping: Mapping = self.groups.mapping if self.groups is not None else Mapping(1, 0, dp=1, cp=1)
        self.is_front = self.mapping.rank == 0
        self.heartbeat_s = heartbeat_s or (self.groups.timeout.total_seconds() / 4 if self.groups else None)
        self._pending: list[list[Command]] = [[] for _ in range(self.mapping.dp)]
        self.life = GenRequestLife()  # every request's state (the only record of it)
        self._load: list[int] = [0] * self.mapping.dp  # live tokens budget per CP group
        # every rank's last report (keys fixed here, so other threads may read a copy at any time)
        first = group_stats(core)[0]  # every group starts alike
        self._rank_stats: dict[tuple[int, int], EngineStats] = {
            (d, c): first for d in range(self.mapping.dp) for c in range(self.mapping.cp)}
        self._kv_failures: dict[str, str] = {}  # request id -> its CP group's agreed transfer error
        # dp_rank -> its group's last reported draft counts (keys fixed here, as _rank_stats')
        self._spec_stats = {d: SpecDecodeStats() for d in range(self.mapping.dp)}
        self._prefix_stats: dict[int, PrefixCacheSnapshot] = {}
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
        pending = self._pending[entry.dp_rank]
        unsent = [c for c in pending if isinstance(c, AddCommand) and c.request_id == request_id]
        if unsent:  # never reached its group: nothing to undo there
            pending.remove(unsent[0])
        else:
            pending.append(AbortCommand(request_id, error))
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
        idle_too_long = self.heartbeat_s is not None and time.monotonic() - self._last_plan > self.heartbeat_s
        # the leader's overlapped step behind the last token holds that request's cache until
        # read; a request started on the core directly (a prefilled start) is the core's to finish
        return (bool(self.life.num_live) or any(self._pending) or idle_too_long
                or self.core.has_unfinished_requests())

    def step(self) -> list[RequestUpdate]:
        """One world step (see the module docstring); on rank 0 the new tokens of every CP
        group's requests, on another leader none."""
        self._check_alive()
        plan = self._take_plan() if self.is_front else broadcast_plan(None, self.groups)
        if plan.shutdown:
            self._leave()
            return []
        dp, group = self.mapping.dp, self.core.group
        counts = (group.num_forwards, group.num_messages) if group is not None else (0, 0)
        try:
            if self.is_front and dp > 1:
                broadcast_plan(plan, self.groups)
            updates = self._apply(plan.commands[self.mapping.dp_rank])
            updates += self.core.step()  # also with nothing to run: an abort's cancels still go to the ranks
            if group is not None:
                group.keep_in_step(dp > 1 and plan.run_model, *counts)
            spec = self.core.spec_stats if self.core.scheduler.drafter is not None else None
            cache = self.core.cache_manager
            prefix = cache.snapshot() if cache.prefix_caching else None
            report = StepReport(self.mapping.rank, self.mapping.dp_rank, 0, updates, group_stats(self.core), spec,
                                prefix)
            reports = gather_reports(report, self.groups) if dp > 1 else [report]
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.error("gen world stopped at step %d on rank %d: %s", plan.step_id, self.mapping.rank, self.failure)
            raise WorldStoppedError(f"the generation world stopped at step {plan.step_id}: {self.failure}") from exc
        return self._absorb(reports) if reports is not None else []

    def _take_plan(self) -> StepPlan:
        plan = StepPlan(self._step_id, self._pending, run_model=bool(self.life.num_live))
        self._pending = [[] for _ in range(self.mapping.dp)]
        for entry in self.life.in_state(GenState.AWAITING_CACHE):  # its AddCommand is in this plan
            self._move(Dispatched(entry.request_id))
        self._step_id += 1
        self._last_plan = time.monotonic()
        return plan

    def _apply(self, commands: list[Command]) -> list[RequestUpdate]:
        """Rank 0 checked each request with the same rules; a refusal here is reported as an error."""
        updates: list[RequestUpdate] = []
        for cmd in commands:
            if isinstance(cmd, AddCommand):
                try:
                    self.core.add_request(cmd.request_id, list(cmd.prompt_token_ids), cmd.params,
                                          hold_cache=cmd.hold_cache, kv_ticket=cmd.kv_ticket,
                                          forced_output_token_ids=cmd.forced_output_token_ids)
                except ValueError as exc:
                    logger.error("CP group leader refused request %s: %s", cmd.request_id, exc)
                    updates.append(RequestUpdate(cmd.request_id, -1, RequestStatus.FINISHED_ERROR, error=str(exc)))
            elif isinstance(cmd, AbortCommand):
                self.core.abort(cmd.request_id, cmd.error)
            else:
                self.core.release(cmd.request_id)
        return updates

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

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """The world's speculative decoding counts (every CP group's, as reported after the last
        step; safe to call from another thread)."""
        return SpecDecodeStats.total(list(self._spec_stats.values()))

    @property
    def prefix_stats(self) -> PrefixCacheSnapshot:
        """The world's prefix cache (every CP group's, as reported after the last step; safe to
        call from another thread)."""
        return PrefixCacheSnapshot.total(list(self._prefix_stats.values()))

    def rank_stats(self) -> dict[tuple[int, int], EngineStats]:
        """``(dp_rank, cp_rank) -> stats`` each rank reported after the last step (a copy; safe
        to call from another thread)."""
        return dict(self._rank_stats)

    # -- world lifetime

    def shutdown(self) -> None:
        """Tell every rank to leave its serve loop (idempotent; skipped after a failure)."""
        if self.is_shut_down or self.failure is not None:
            return
        if self.groups is not None and self.mapping.dp > 1:
            broadcast_plan(StepPlan(self._step_id, [[] for _ in range(self.mapping.dp)], False, True), self.groups)
        self._leave()

    def _leave(self) -> None:
        self.is_shut_down = True
        if self.core.group is not None:
            self.core.group.shutdown()

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
            if report.spec_stats is not None:
                self._spec_stats[report.dp_rank] = report.spec_stats
            if report.prefix_stats is not None:
                self._prefix_stats[report.dp_rank] = report.prefix_stats
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


def group_stats(core: EngineCore) -> list[EngineStats]:
    """Each CP rank's stats: the group's request counts, the rank's own blocks and slots."""
    total = core.stats()
    return [EngineStats(total.num_running, total.num_waiting, total.num_held, c.num_blocks, c.num_used_blocks,
                        c.num_slots, c.num_used_slots) for c in core.cache_manager.rank_stats()]


def serve_leader(driver: WorldDriver) -> int:
    """The loop of a CP leader other than rank 0: world steps until the shutdown plan; the step
    count. Raises on any failure (a collective timed out, a forward raised): the process should
    then end, so that the other ranks' collectives fail fast."""
    steps = 0
    while True:
        driver.step()
        if driver.is_shut_down:
            return steps
        steps += 1


def drive_to_completion(driver: WorldDriver, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                        tokenizer: HelixTokenizer | None = None, request_ids: Sequence[str] | None = None,
                        ) -> list[GenerationResult]:
    """Add every prompt, step the driver until all finish; results in prompt order. Every request
    it added and that did not finish is aborted when it raises."""
    ids = list(request_ids) if request_ids is not None else [f"world-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    errors: dict[str, str | None] = {}
    try:
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            driver.add_request(rid, list(prompt), p)
        while driver.has_unfinished_requests():
            for update in driver.step():
                if update.request_id not in tokens:
                    continue
                if update.status not in (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED):
                    tokens[update.request_id].append(update.token_id)
                if update.is_finished:
                    reasons[update.request_id] = update.status.finish_reason
                    errors[update.request_id] = update.error
    finally:
        for rid in ids:
            if rid not in reasons:
                driver.abort(rid)
    results = []
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        text = truncate_at_stop(tokenizer.decode(tokens[rid]), p.stop) if tokenizer else ""
        results.append(GenerationResult(rid, list(prompt), tokens[rid], text, reasons.get(rid), errors.get(rid)))
    return results

