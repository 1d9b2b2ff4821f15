"""Every rank's part of a gen world step: :class:`RankEngine` and the worker loop :func:`serve_rank`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from helixserve.engine.core import EngineStats
from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.runner import build_forward_batch
from helixserve.engine.sampler import Sampler
from helixserve.engine.scheduler import RequestUpdate, Scheduler
from helixserve.engine.spmd.messages import (
    AbortCommand,
    AddCommand,
    Command,
    KVReceiver,
    StepPlan,
    StepReport,
    broadcast_plan,
    gather_reports,
)
from helixserve.engine.stop import StopChecker
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import reset_slots
from helixserve.models.context import ModelCaches
from helixserve.models.kimi import KimiForCausalLM
from helixserve.parallel import CollectiveError, ParallelGroups
from helixserve.transceiver.consensus import LocalStatus, TransferConsensus

logger = logging.getLogger(__name__)

_FAILED = -1  # a sampled token that marks a failed sampling (token ids are >= 0)


class RankEngine:
    """One rank's scheduler replica, cache shard, model and sampler (see the module docstring)."""

    def __init__(self, model: KimiForCausalLM, groups: ParallelGroups, caches: ModelCaches,
                 cache_manager: CacheManager, scheduler: Scheduler, seed: int = 0) -> None:
        self.model, self.groups, self.caches = model, groups, caches
        self.mapping = groups.mapping
        self.cache_manager, self.scheduler = cache_manager, scheduler
        self.sampler = Sampler(groups.device, seed=seed)
        self.kv_receiver: KVReceiver | None = None
        # agreement on transfer outcomes with the other ranks of this CP group (cp = 1: local)
        self.consensus = TransferConsensus(groups.cp) if self.mapping.cp > 1 else TransferConsensus(is_local=True)
        self._params: dict[str, SamplingParams] = {}
        self._awaiting_kv: dict[str, Request] = {}  # shard in flight or not yet agreed (CP-group-uniform)
        self._kv_outcomes: dict[str, str | None] = {}  # this rank's ended transfers: None ok, else error
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
        report = StepReport(self.mapping.rank, self.mapping.dp_rank, self.mapping.cp_rank)
        report.updates += self._apply(plan.commands[self.mapping.dp_rank])
        report.updates += self._agree_kv()
        report.updates += self._start_ready()
        if plan.run_model:
            report.updates += self._run()
        report.stats = self.stats()  # every rank: each CP rank holds its own share of the blocks
        if not self.mapping.is_cp_leader:
            report.updates = []
        return report

    def _run(self) -> list[RequestUpdate]:
        """One scheduled step. A failure outside the model's forward ends the step's requests on
        this CP group (error updates) and the world goes on: building the batch fails alike on
        every rank of the group (same plan, same replica), which then still joins the world's MoE
        all-to-alls with no rows; a failed sampling on the CP leader reaches the other ranks as
        its token broadcast. A forward that raises stops the world (its collectives unmatched)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            self.model.empty_step()
            return []
        try:
            if out.reset_slot_ids:
                reset_slots(self.caches, out.reset_slot_ids)
            batch = build_forward_batch(out, self.groups.device)
        except Exception as exc:  # noqa: BLE001 - reported on the step's requests
            self.model.empty_step()
            return self._fail_step(f"{type(exc).__name__}: {exc}")
        logits = self.model(batch, self.caches)
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        tokens, sample_error = self._sample(logits, sampled_ids)
        tokens = self._leader_tokens(tokens)
        if _FAILED in tokens:
            return self._fail_step(sample_error or "sampling failed on the CP leader")
        try:
            updates = self.scheduler.update_from_output(out, dict(zip(sampled_ids, tokens, strict=True)))
        except Exception as exc:  # noqa: BLE001 - reported on the step's requests
            return self._fail_step(f"{type(exc).__name__}: {exc}")
        self._forget([u.request_id for u in updates if u.is_finished])
        return updates

    def _sample(self, logits: torch.Tensor, sampled_ids: list[str]) -> tuple[list[int], str | None]:
        """This rank's tokens, or ``_FAILED`` ones and the cause when sampling raised."""
        if not sampled_ids:
            return [], None
        try:
            return self.sampler(logits, sampled_ids, [self._params[r] for r in sampled_ids]), None
        except Exception as exc:  # noqa: BLE001 - the leader's failure is the group's
            logger.error("rank %d: sampling failed", self.mapping.rank, exc_info=exc)
            return [_FAILED] * len(sampled_ids), f"{type(exc).__name__}: {exc}"

    def _fail_step(self, cause: str) -> list[RequestUpdate]:
        message = f"engine step failed on gen rank {self.mapping.rank}: {cause}"
        request_ids = self.scheduler.fail_pending_step(message)
        logger.error("%s; failed requests %s", message, request_ids)
        self._forget(request_ids)
        return [RequestUpdate(rid, -1, RequestStatus.FINISHED_ERROR, error=message) for rid in request_ids]

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
            else:
                self.scheduler.release(cmd.request_id)
        return updates

    def _add(self, cmd: AddCommand) -> list[RequestUpdate]:
        request = Request(cmd.request_id, list(cmd.prompt_token_ids), cmd.params,
                          hold_cache_on_finish=cmd.hold_cache,
                          forced_output_token_ids=list(cmd.forced_output_token_ids))
        try:
            if cmd.kv_ticket is None:
                self.scheduler.add_request(request)
            else:
                self.consensus.mark_active()  # every rank of the group applies this command now
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

    def _agree_kv(self) -> list[RequestUpdate]:
        """This step's transfer outcomes agreed over the CP group (one all-gather of every rank's
        ``LocalStatus``, see :mod:`helixserve.transceiver.consensus`): a request starts decoding
        only once every rank of the group has its shard; a failure (or timeout) on any rank fails
        it on every rank, with the first rank's cause. ``_awaiting_kv`` is the same on every rank
        of the group (moved only by the group's commands and by agreed outcomes), so every rank
        enters the collective, or skips it, alike."""
        if not self._awaiting_kv:
            return []
        if self.kv_receiver is not None:
            for request_id, error in self.kv_receiver.poll().items():
                if request_id in self._awaiting_kv:
                    self._kv_outcomes[request_id] = error
        failed = {rid: error for rid, error in self._kv_outcomes.items() if error is not None}
        status = LocalStatus.of(failed=failed, completed=[r for r, e in self._kv_outcomes.items() if e is None])
        try:
            agreed = self.consensus.check(status, failed)
        except RuntimeError as exc:
            raise CollectiveError(f"KV consensus failed on rank {self.mapping.rank}: {exc}") from exc
        updates: list[RequestUpdate] = []
        for request_id in [r for r in self._awaiting_kv if r in agreed.failed | agreed.cancelled]:
            updates += self._fail_kv(request_id, agreed.errors.get(request_id)
                                     or f"request {request_id}: KV transfer failed on its CP group")
        for request_id in [r for r in self._awaiting_kv if r in agreed.ready]:
            self._kv_ready(self._awaiting_kv.pop(request_id))
            self._kv_outcomes.pop(request_id, None)
        return updates

    def _fail_kv(self, request_id: str, error: str) -> list[RequestUpdate]:
        """This rank's transfer, or another rank's, failed: stop ours, free the shard."""
        request = self._awaiting_kv.pop(request_id)
        self._kv_outcomes.pop(request_id, None)
        if self.kv_receiver is not None:
            self.kv_receiver.cancel(request_id)  # nothing writes into the handle after this
        self.cache_manager.free(request_id)
        self._forget([request_id])
        return [RequestUpdate(request.request_id, -1, RequestStatus.FINISHED_ERROR, error=error)]

    def _kv_ready(self, request: Request) -> None:
        if request.sampling_params.seed is not None and not request.sampling_params.is_greedy:
            # the draws sampling the first tokens made on the ctx worker (outputs == aggregated run)
            generator = self.sampler._generator(request.request_id, request.sampling_params)  # noqa: SLF001
            for _ in request.forced_output_token_ids:
                torch.empty(self.model.cfg.vocab_size, device=self.groups.device).exponential_(generator=generator)
        self._ready_kv[request.request_id] = request

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
            self._kv_outcomes.pop(request_id, None)
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
        plan = broadcast_plan(None, rank.groups)
        if plan.shutdown:
            return steps
        gather_reports(rank.step(plan), rank.groups)
        steps += 1
