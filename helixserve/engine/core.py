"""Engine core: one scheduler, one model runner, continuous batching; the only engine.

``step()`` is schedule -> launch -> postprocess. Servers and the Python API drive it; it knows no
HTTP. It runs in two places:

- a single process (``LLM``, ctx workers, aggregated workers): steps run on its
  :class:`~helixserve.engine.runner.ModelRunner`;
- the leader of each CP group of a gen world (``groups`` given): the scheduler is the group's only one, over the
  group's cache (every CP rank's allocator, :class:`~helixserve.kvcache.group_cache.GroupCacheManager`), and its
  :class:`~helixserve.engine.spmd.leader.GroupLeader` sends each step to the group's other ranks before it runs here
  and shares the sampled tokens. Requests whose prompt cache arrives from a ctx worker enter through
  :class:`~helixserve.engine.kv_intake.KVIntake` (``add_request(..., kv_ticket=...)``).

With ``speculative`` a decoding request's row carries drafts (``ngram``; ``draft`` / ``hidden``: a model
drafter's, :mod:`.model_drafters`, on the leader of a world's group, or a heads-TP drafter on all of
its ranks), the target verifies them in the same forward and a rejection rolls its KDA state (and the draft's) back
(:mod:`helixserve.engine.spec`; in a world on every rank, :mod:`.spmd.leader`); nothing overlaps a verify step. A
single-process engine (or a world of one) with CUDA graphs replays captured verify steps and their rollbacks
(:mod:`.cuda_graphs`; a step with a prompt chunk, and every verify step of a larger world, runs eagerly). While no
request would draft (``ngram``), decode steps overlap as without speculation (:mod:`.spec.drafting`); a model
drafter turns overlapped decoding off.

A world of one (dp 1 x cp 1) is this class on the same model with the same caches, CUDA graphs and overlapped
decoding: its tokens are the single process's. With dp > 1 every DP group must run one forward per world step (the
MoE all-to-alls pair them up), so overlapped decoding, which launches two steps in one, is off there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.admission import check_engine_request
from helixserve.engine.engine_parts import build_engine_parts
from helixserve.engine.engine_stats import EngineStats
from helixserve.engine.kv_holds import HoldRelay
from helixserve.engine.kv_intake import KVIntake, RankTransfers, ShardReceiver
from helixserve.engine.rank_setup import step_token_budget
from helixserve.engine.request import Request, SamplingParams
from helixserve.engine.runner import LaunchedStep
from helixserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from helixserve.engine.spec.drafting import make_drafter
from helixserve.engine.spec.stats import SpecDecodeStats
from helixserve.engine.spec.verify_step import kept_rows
from helixserve.engine.spmd.channel import GroupChannel
from helixserve.engine.spmd.leader import GroupLeader
from helixserve.engine.step_failures import StepFailures
from helixserve.kernels.triton_common import batch_invariant_enabled
from helixserve.models.kda_spec import KdaRecord
from helixserve.models.config import KimiModelConfig
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.parallel import CollectiveError, ParallelGroups
from helixserve.transceiver.consensus import TransferConsensus
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class EngineCore(StepFailures):
    """Owns the scheduler (queues, cache accounting) and the model runner (tensors); see the module docstring.
    ``groups``: this process is the leader (``cp_rank == 0``) of a gen world's CP group; ``kv_receiver``: its
    receiver of prompt caches from ctx workers."""

    def __init__(self, model: torch.nn.Module, model_config: KimiModelConfig, tokenizer: HelixTokenizer | None,
                 cache: CacheConfig = CacheConfig(), scheduler: SchedulerConfig = SchedulerConfig(),
                 device: torch.device | str = "cpu", seed: int = 0, use_cuda_graphs: bool = True,
                 groups: ParallelGroups | None = None, kv_receiver: ShardReceiver | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        mapping = groups.mapping if groups is not None else None
        if mapping is not None and mapping.cp_rank != 0:
            raise ValueError(f"an EngineCore runs on a CP group's leader, not on rank {mapping.rank}")
        cp, world_size = (mapping.cp, mapping.world_size) if mapping is not None else (1, 1)
        parts = build_engine_parts(model, model_config, cache, scheduler, device, seed, use_cuda_graphs, speculative,
                                   cp, world_size, groups)
        self.layout, self.caches, self.runner = parts.layout, parts.caches, parts.runner
        self.cache_manager, self.draft_runner = parts.cache_manager, parts.draft_runner
        self.transfer_caches = parts.transfer_caches  # what a request's KV transfer reads or writes
        max_model_len = self.layout.max_model_len
        self.group: GroupLeader | None = None
        self.kv_intake: KVIntake | None = None
        self.kv_holds: HoldRelay | None = None  # a ctx world's leader: every rank's KV sender (engine.kv_holds)
        if groups is not None:
            self.group = GroupLeader(self.runner, self.cache_manager, GroupChannel(groups))  # type: ignore[arg-type]
            consensus = TransferConsensus(groups.cp_cpu) if cp > 1 else TransferConsensus(is_local=True)
            self.transfers = RankTransfers(kv_receiver, self.transfer_caches, consensus)
            self.kv_intake = KVIntake(self.cache_manager, self.transfers, self.group if cp > 1 else None)
            if self.draft_runner is not None and self.draft_runner.is_tensor_parallel:
                self.draft_runner.announce = self.group.send_draft  # the group runs the drafter's forwards too
        eos = set(tokenizer.eos_token_ids) if tokenizer else set()
        if model_config.eos_token_id is not None:
            eos.add(model_config.eos_token_id)
        self.scheduler = Scheduler(
            self.cache_manager, max_num_seqs=cache.max_num_seqs,
            max_num_batched_tokens=step_token_budget(cache, scheduler), max_model_len=max_model_len,
            eos_token_ids=eos, detokenize=tokenizer.decode if tokenizer else None,
            drafter=make_drafter(speculative, max_model_len) if speculative is not None else None,
            aligned_chunks=batch_invariant_enabled())
        self.spec_stats = SpecDecodeStats()
        self._params: dict[str, SamplingParams] = {}
        # overlapped decoding pays where the device runs ahead of the host: with CUDA graphs
        overlap = scheduler.overlap_decode
        self.overlap_decode = self.runner.decode_graphs is not None if overlap is None else overlap
        if (mapping is not None and mapping.dp > 1) or self.draft_runner is not None:
            # one forward per world step; a model drafter reads every step's input tokens on the host
            self.overlap_decode = False
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.num_step_errors = 0
        self._where = f" on gen rank {mapping.rank}" if mapping is not None else ""
        logger.info("engine ready: %s, overlapped decoding %s", self.layout, self.overlap_decode)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      forced_output_token_ids: Sequence[int] = (), has_kv: bool = False,
                      request_id: str = "request") -> None:
        """``ValueError`` for a request this engine could never run (what ``add_request`` checks
        first; a world's front checks with it before choosing the request's group)."""
        request = Request(request_id, list(prompt_token_ids), params,
                          forced_output_token_ids=list(forced_output_token_ids))
        check_engine_request(request, self.model_config.vocab_size, self.scheduler.max_model_len, self.cache_manager,
                             can_detokenize=self.scheduler.detokenize is not None, has_kv=has_kv,
                             receives_kv=self.kv_intake is not None)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_cache: bool = False,
        forced_output_token_ids: Sequence[int] = (),
        kv_ticket: KVTicket | None = None,
    ) -> Request:
        """Queue a request; ``ValueError`` if it could never run (too long, bad ids).

        ``hold_cache``: on a stop/length finish keep the cache until :meth:`release` (a ctx
        prefill awaiting its gen worker). ``forced_output_token_ids``: the first outputs are these tokens
        instead of the sampled ones (sampling still runs, so a seeded generator advances as if it
        had drawn them). ``kv_ticket``: the prompt's cache comes from a ctx worker (passed to
        every rank's ``ShardReceiver.start``); ``forced_output_token_ids`` are the ctx's first tokens.
        """
        self.check_request(prompt_token_ids, params, forced_output_token_ids, kv_ticket is not None, request_id)
        if self.kv_intake is not None and request_id in self.kv_intake:
            raise ValueError(f"request id {request_id!r} is already in the scheduler")
        if kv_ticket is not None:
            self.scheduler.check_new_id(request_id)
        request = Request(
            request_id, list(prompt_token_ids), params, hold_cache_on_finish=hold_cache,
            forced_output_token_ids=list(forced_output_token_ids),
        )
        if kv_ticket is not None:
            assert self.kv_intake is not None  # check_request refused it otherwise
            self.kv_intake.add(request, kv_ticket)
        else:
            self.scheduler.add_request(request)
        self._params[request_id] = params
        return request

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request and free its cache (a held one too); False if unknown or already freed."""
        aborted = ((self.kv_intake is not None and self.kv_intake.abort(request_id))
                   or self.scheduler.abort(request_id, error=error) or self.scheduler.release(request_id))
        self._forget([request_id])
        return aborted

    def release(self, request_id: str) -> bool:
        """Free a held request's cache (picked up, or its hold deadline passed)."""
        return self.scheduler.release(request_id)

    def abort_all(self, error: str) -> list[str]:
        """Fail every unfinished request with ``error`` and drop a step still in flight (shutdown);
        returns their ids. Held caches stay held. (A failed step fails only its own requests:
        see :meth:`step`.)"""
        request_ids = self.scheduler.unfinished_request_ids
        if self.kv_intake is not None:
            received = self.kv_intake.abort_all()
            self._forget(received)
        for rid in request_ids:
            self.scheduler.abort(rid, error=error)
        self._in_flight = None
        self.scheduler.fail_pending_step(error)
        self._forget(request_ids)
        return request_ids + (received if self.kv_intake is not None else [])

    def stats(self) -> EngineStats:
        received = self.kv_intake.num_waiting if self.kv_intake else 0
        return EngineStats.of(self.scheduler.num_running, self.scheduler.num_waiting + received,
                              self.scheduler.num_held, self.cache_manager.stats())

    @property
    def has_step_in_flight(self) -> bool:
        """An overlapped step is still to be read back (it holds finished requests' caches)."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        """Requests to run or to receive, or an overlapped step still to be read back."""
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or (self.kv_intake is not None and self.kv_intake.num_waiting > 0))

    def can_add_prefilled_request(self) -> bool:
        return self.scheduler.can_add_prefilled()

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_ids: Sequence[int], params: SamplingParams
    ) -> list[RequestUpdate]:
        """Start decoding a request whose prompt KV / state is already in this engine's cache: a
        KV transfer filled the handle ``cache_manager`` holds for ``request_id``. ``first_token_ids``
        are the ctx worker's sampled first outputs; they are returned as this request's first
        updates. A seeded request's generator advances as if it had drawn them, so the tokens
        equal an aggregated run. ``ValueError`` if it cannot start (see ``Scheduler.add_prefilled``).
        """
        vocab = self.model_config.vocab_size
        bad = [t for t in (*prompt_token_ids, *first_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:8]}")
        request = Request(request_id, list(prompt_token_ids), params,
                          forced_output_token_ids=list(first_token_ids))
        updates = self._start_prefilled(request)
        self._params[request_id] = params
        return updates

    def _start_prefilled(self, request: Request) -> list[RequestUpdate]:
        updates = self.scheduler.add_prefilled(request)
        if self.draft_runner is not None:  # a received prompt: the drafter's cache of it is built here
            self.draft_runner.prefill(request, self.scheduler.max_num_batched_tokens)
        params = request.sampling_params
        if params.seed is not None and not params.is_greedy:
            generator = self.runner.sampler.generator(request.request_id, params)
            for _ in request.forced_output_token_ids:  # the draws sampling the first tokens would have made
                torch.empty(self.model_config.vocab_size, device=self.runner.device).exponential_(generator=generator)
        return updates

    def step(self) -> list[RequestUpdate]:
        """Schedule, run the model, apply the sampled tokens; returns this step's new tokens. With
        overlapped decoding the next decode step is enqueued (``Scheduler.schedule_ahead``, fed
        the sampled tokens on the device) before this step's tokens are read back.

        A request's failure is its own: a step is prepared (each request's sampling, the batch)
        before any model code runs, and one that cannot be runs again without the requests the
        failure is traced to (else without each request that fails to prepare alone); those end
        with a ``FINISHED_ERROR`` update naming the cause and nothing of them stays allocated. A
        request whose stop rules raise ends alone likewise. A step that raises past that (the
        model, a kernel, sampling: the caches were written, it cannot run again) ends the requests
        it concerns (those of the failed step and of a step enqueued ahead; every unfinished one
        when scheduling itself failed) with ``FINISHED_ERROR`` updates whose ``error`` names the
        exception, frees their caches and leaves the engine ready for the next step. In a world, a failure that
        leaves the ranks' collectives unmatched (a :class:`CollectiveError`: a forward or message
        failed) is raised instead: the world has stopped.

        Received requests (a gen world's) are admitted, agreed on and started first
        (:class:`KVIntake`); transfer failures come with this step's tokens. When only requests
        that start in this step would decode, their first tokens return at once, before any model
        step: the ctx sampled them, and holding them for the decode step would add that step to
        their time to first token; the next call runs the step. With other requests to run, the
        first tokens come with this step's (an extra host round per start would stall the
        others' decoding), as with a step in flight. The transfers' poll waits (a bounded while,
        for one to end) only when nothing else would run: decode steps never wait on it.
        """
        updates, is_done = self._intake()
        if is_done:
            return updates
        failed: list[RequestUpdate] = []
        try:
            if self._in_flight is not None:
                (out, launched), self._in_flight = self._in_flight, None
            else:
                out = self.scheduler.schedule()
                if out.is_empty:
                    return updates
                launched = self._launch(out, None, failed)
            if self.overlap_decode and launched.tokens is not None:
                ahead = self.scheduler.schedule_ahead()
                if ahead is not None:
                    self._in_flight = (ahead, self._launch(ahead, launched.tokens, failed))
            applied = self.scheduler.update_from_output(out, launched.result())
            if launched.verified is not None:
                self._verified(out, launched)
            finished = [u.request_id for u in applied if u.is_finished]
            if self.draft_runner is not None:  # a held prefill's drafter cache, completed to travel with it
                self.draft_runner.hold([rid for rid in finished if self.scheduler.is_held(rid)])
            self._forget(finished)
            return updates + failed + applied
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - the failure is reported on the requests
            return updates + failed + self._fail_step(exc)

    def _intake(self) -> tuple[list[RequestUpdate], bool]:
        """Received requests admitted, agreed on and started (see :meth:`step`); their updates,
        and whether the step returns with them at once."""
        if self.kv_intake is None:
            return [], False
        idle = self._in_flight is None and not self.scheduler.has_unfinished_requests()
        updates = self.kv_intake.step(self.scheduler.can_add_prefilled, self._start_prefilled, idle)
        self._forget([u.request_id for u in updates if u.is_finished])
        started = {u.request_id for u in updates if not u.is_finished}
        is_done = bool(started and self._in_flight is None and not self.scheduler.waiting
                       and all(r.request_id in started for r in self.scheduler.running))
        return updates, is_done

    def _launch(self, out: SchedulerOutput, input_tokens: torch.Tensor | None,
                failed: list[RequestUpdate]) -> LaunchedStep:
        """Enqueue ``out`` (forward, sampling, the tokens' copy to the host) without waiting for
        it; in a world the group's other ranks run it too. ``failed`` gets the requests dropped
        from a step that could not be prepared (:meth:`_prepare`)."""
        draft_record = self._propose(out)
        prepared, input_tokens = self._prepare(out, input_tokens, failed)
        if out.is_empty:
            return LaunchedStep([], None, None, None)
        if self.group is not None:
            self.group.send_launch(out, input_tokens)
        try:
            logits = (self.runner.run(prepared) if prepared is not None
                      else self.runner.run_step(out, None, input_tokens))
        except Exception as exc:
            if self.group is not None and self.group.world_size > 1:  # the ranks' collectives are unmatched now
                raise CollectiveError(f"forward failed on rank {self.group.channel.mapping.rank}: "
                                      f"{type(exc).__name__}: {exc}") from exc
            raise
        if self.draft_runner is not None and prepared is not None:
            self.draft_runner.record(out, prepared.batch)
        launched = self._sample(out, logits)
        launched.kda_record = prepared.batch.kda_record if prepared is not None else self.runner.replayed_record
        launched.draft_record = draft_record
        return launched

    def _propose(self, out: SchedulerOutput) -> KdaRecord | None:
        """The model drafter's drafts written into ``out`` (its KDA record returned); a heads-TP
        drafter that fails leaves its group's all-reduces unmatched: the world has stopped."""
        if self.draft_runner is None:
            return None
        try:
            return self.draft_runner.propose(out)
        except Exception as exc:
            if self.draft_runner.is_tensor_parallel:
                raise CollectiveError(f"draft forward failed{self._where}: {type(exc).__name__}: {exc}") from exc
            raise

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> LaunchedStep:
        """Sample ``out``'s sampled rows, or verify its drafts (a world's leader shares the tokens
        with its group; it alone verifies)."""
        if self.group is None:
            return self.runner.sample(out, logits, self._params)
        return self.group.sample(out, logits, self._params)

    def _verified(self, out: SchedulerOutput, launched: LaunchedStep) -> None:
        """A verify step's accepted drafts counted, the KDA state of rejected ones rolled back
        (on every rank of a world's group)."""
        assert launched.verified is not None
        self.spec_stats.add(launched.verified.accepted)
        if launched.kda_record is not None:
            keep = kept_rows(out, launched.kda_record, self.scheduler.get_request)
            self.runner.rollback(launched.kda_record, keep)
            if self.group is not None:
                self.group.share_rollback(keep)
        if launched.draft_record is not None and self.draft_runner is not None:
            self.draft_runner.rollback(out, launched.draft_record, self.scheduler.get_request)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._params.pop(rid, None)
        self.runner.release(request_ids)
        if self.draft_runner is not None:
            self.draft_runner.forget(request_ids)
