"""Engine core: one process, one model, continuous batching.

``step()`` is schedule -> run -> postprocess. Servers and the Python API drive it; it knows no
HTTP and no transfers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.runner import LaunchedStep, ModelRunner
from helixserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from helixserve.kernels.triton_common import has_fla
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import allocate_model_caches, size_from_budget
from helixserve.models.config import KimiModelConfig
from helixserve.models.tokenizer import HelixTokenizer

logger = logging.getLogger(__name__)

_MIB = 1 << 20


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot for health, load balancing and metrics."""

    num_running: int
    num_waiting: int
    num_held: int  # finished, cache kept for pickup
    num_blocks: int
    num_used_blocks: int
    num_slots: int
    num_used_slots: int


@dataclass(slots=True, frozen=True)
class CacheLayout:
    """Derived once at start-up from the cache config and the model."""

    num_blocks: int
    num_slots: int
    tokens_per_block: int
    max_model_len: int


class EngineCore:
    """Owns the scheduler (queues, cache accounting) and the runner (tensors)."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: KimiModelConfig,
        tokenizer: HelixTokenizer | None,
        cache: CacheConfig = CacheConfig(),
        scheduler: SchedulerConfig = SchedulerConfig(),
        device: torch.device | str = "cpu",
        seed: int = 0,
        use_cuda_graphs: bool = True,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        spec = cache_spec_for(model_config, model.dtype, cache.tokens_per_block)
        num_blocks, num_slots = size_from_budget(spec, int(cache.memory_budget_mib * _MIB), cache.max_num_seqs)
        max_model_len = min(cache.max_model_len or model_config.max_position_embeddings, num_blocks * cache.tokens_per_block)
        self.layout = CacheLayout(num_blocks, num_slots, cache.tokens_per_block, max_model_len)
        is_cuda = torch.device(device).type == "cuda"
        # on CUDA one slot more than the manager hands out: the scratch slot of padded graph rows
        caches = allocate_model_caches(spec, num_blocks, num_slots + int(is_cuda), device)
        self.runner = ModelRunner(model, caches, device, seed=seed)
        # graphs need the fast kernels: the PyTorch references read metadata on the host and
        # check slot ids (padded rows repeat the scratch slot), neither of which a graph can hold
        if is_cuda and use_cuda_graphs and has_fla():
            self.runner.capture_decode_graphs(
                min(cache.max_num_seqs, num_slots), -(-max_model_len // cache.tokens_per_block), num_slots
            )
        elif is_cuda and use_cuda_graphs:
            logger.info("decode CUDA graphs off: the fast kernels (fla, Triton) are not in use")
        self.cache_manager = CacheManager(
            num_blocks, num_slots, cache.tokens_per_block,
            has_mla=bool(spec.mla_layer_ids), has_kda=bool(spec.kda_layer_ids),
        )
        eos = set(tokenizer.eos_token_ids) if tokenizer else set()
        if model_config.eos_token_id is not None:
            eos.add(model_config.eos_token_id)
        self.scheduler = Scheduler(
            self.cache_manager,
            max_num_seqs=cache.max_num_seqs,
            max_num_batched_tokens=max(scheduler.max_num_batched_tokens, cache.max_num_seqs),
            max_model_len=max_model_len,
            eos_token_ids=eos,
            detokenize=tokenizer.decode if tokenizer else None,
        )
        self._params: dict[str, SamplingParams] = {}
        # overlapped decoding pays where the device runs ahead of the host: with CUDA graphs
        overlap = scheduler.overlap_decode
        self.overlap_decode = self.runner.decode_graphs is not None if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.num_step_errors = 0
        logger.info("engine ready: %s, overlapped decoding %s", self.layout, self.overlap_decode)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_cache: bool = False,
        forced_output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request; ``ValueError`` if it could never run (too long, bad ids).

        ``hold_cache``: on a stop/length finish keep the cache until :meth:`release` (a ctx
        prefill awaiting pickup). ``forced_output_token_ids``: the first outputs are these tokens
        instead of the sampled ones (sampling still runs, so a seeded generator advances as if it
        had drawn them).
        """
        vocab = self.model_config.vocab_size
        bad = [t for t in (*prompt_token_ids, *forced_output_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:8]}")
        if len(forced_output_token_ids) > params.max_tokens:
            raise ValueError(
                f"{len(forced_output_token_ids)} forced output tokens exceed max_tokens={params.max_tokens}"
            )
        request = Request(
            request_id, list(prompt_token_ids), params, hold_cache_on_finish=hold_cache,
            forced_output_token_ids=list(forced_output_token_ids),
        )
        self.scheduler.add_request(request)
        self._params[request_id] = params
        return request

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request and free its cache (a held one too); False if unknown or already freed."""
        aborted = self.scheduler.abort(request_id, error=error) or self.scheduler.release(request_id)
        self._forget([request_id])
        return aborted

    def release(self, request_id: str) -> bool:
        """Free a held request's cache (picked up, or its pickup deadline passed)."""
        return self.scheduler.release(request_id)

    def abort_all(self, error: str) -> list[str]:
        """Fail every unfinished request with ``error`` and drop a step still in flight (shutdown);
        returns their ids. Held caches stay held. (A failed step fails only its own requests:
        see :meth:`step`.)"""
        request_ids = self.scheduler.unfinished_request_ids
        for rid in request_ids:
            self.scheduler.abort(rid, error=error)
        self._in_flight = None
        self.scheduler.fail_pending_step(error)
        self._forget(request_ids)
        return request_ids

    def stats(self) -> EngineStats:
        cache = self.cache_manager.stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_held=self.scheduler.num_held,
            num_blocks=cache.num_blocks,
            num_used_blocks=cache.num_used_blocks,
            num_slots=cache.num_slots,
            num_used_slots=cache.num_used_slots,
        )

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or an overlapped step still to be read back (its caches to free)."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

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
        updates = self.scheduler.add_prefilled(request)
        self._params[request_id] = params
        if params.seed is not None and not params.is_greedy:
            generator = self.runner.sampler._generator(request_id, params)  # noqa: SLF001
            for _ in first_token_ids:  # the draws sampling the first tokens would have made
                torch.empty(vocab, device=self.runner.device).exponential_(generator=generator)
        return updates

    def step(self) -> list[RequestUpdate]:
        """Schedule, run the model, apply the sampled tokens; returns this step's new tokens.

        With overlapped decoding the next decode step is enqueued (``Scheduler.schedule_ahead``,
        fed the sampled tokens on the device) before this step's tokens are read back, so the
        device runs it while the host applies them; the next call starts from that step.

        A step that raises (the model, a kernel, sampling) ends the requests it concerns (those
        of the failed step and of a step enqueued ahead; every unfinished one when scheduling
        itself failed) with ``FINISHED_ERROR`` updates whose ``error`` names the exception, frees
        their caches and leaves the engine ready for the next step.
        """
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 - the failure is reported on the requests
            return self._fail_step(exc)

    def _step(self) -> list[RequestUpdate]:
        if self._in_flight is not None:
            (out, launched), self._in_flight = self._in_flight, None
        else:
            out = self.scheduler.schedule()
            if out.is_empty:
                return []
            launched = self.runner.launch(out, self._params)
        if self.overlap_decode:
            ahead = self.scheduler.schedule_ahead()
            if ahead is not None:
                self._in_flight = (ahead, self.runner.launch(ahead, self._params, input_tokens=launched.tokens))
        updates = self.scheduler.update_from_output(out, launched.result())
        self._forget([u.request_id for u in updates if u.is_finished])
        return updates

    def _fail_step(self, exc: Exception) -> list[RequestUpdate]:
        self.num_step_errors += 1
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        self._in_flight = None
        request_ids = self.scheduler.fail_pending_step(message)
        logger.error("%s; failed requests %s", message, request_ids, exc_info=exc)
        self._forget(request_ids)
        return [RequestUpdate(rid, -1, RequestStatus.FINISHED_ERROR, error=message) for rid in request_ids]

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._params.pop(rid, None)
        self.runner.release(request_ids)
