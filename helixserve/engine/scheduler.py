"""Continuous-batching scheduler with chunked prefill and recompute preemption (torch-free).

Each ``schedule()`` step, under a token budget of ``max_num_batched_tokens``:

1. every running request that is decoding gets its one token (the last sampled one); if its
   cache cannot grow, the most recently admitted running request is preempted (cache freed,
   requeued at the front of ``waiting`` to be recomputed from scratch) until it can;
2. running requests still in a chunked prefill get their next chunk;
3. unless something was preempted this step, waiting requests are admitted FCFS while there are
   sequence slots, budget and cache for their whole prompt (back-pressure: the head of the queue
   waits, nobody jumps it).

Only the final chunk of a prefill is sampled. ``update_from_output`` appends the sampled tokens,
applies the stop rules (eos unless ``ignore_eos``, ``stop_token_ids``, stop strings through a
``detokenize`` callable, ``max_tokens``, ``max_model_len``) and frees finished requests' caches.
``schedule_ahead`` schedules the next decode step before the pending one's tokens are known.

A request with ``hold_cache_on_finish`` (a ctx worker's prefill awaiting pickup) that finishes by
stop or length keeps its cache, *held*: it no longer runs or counts as unfinished, but its blocks
and slot stay allocated until ``release(request_id)``. An abort or error frees at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.scheduler_output import RequestUpdate, ScheduledSeq, SchedulerOutput
from helixserve.engine.stop import Detokenize, StopChecker
from helixserve.kvcache.manager import CacheManager

__all__ = ["RequestUpdate", "ScheduledSeq", "Scheduler", "SchedulerOutput"]

_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler:
    def __init__(
        self,
        cache_manager: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        detokenize: Detokenize | None = None,
    ) -> None:
        if not 1 <= max_num_seqs <= max_num_batched_tokens:
            raise ValueError(
                f"need 1 <= max_num_seqs ({max_num_seqs}) <= max_num_batched_tokens "
                f"({max_num_batched_tokens}) so every running decode fits in a step"
            )
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.cache = cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; preemption takes from the end
        self._requests: dict[str, Request] = {}
        self._stop_checkers: dict[str, StopChecker] = {}
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._pending_requests: dict[str, Request] = {}
        self._ahead: SchedulerOutput | None = None  # see schedule_ahead
        self._ahead_requests: dict[str, Request] = {}
        # requests of a step scheduled ahead and not yet updated: caches freed once it is
        self._in_flight: set[str] = set()
        self._deferred_frees: list[str] = []
        self._held: dict[str, Request] = {}  # finished, cache kept for pickup until release()

    # -- queue -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ``ValueError`` for one that could never run."""
        rid, params = request.request_id, request.sampling_params
        self._check_new_id(rid)
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed)")
        if not 1 <= request.num_tokens < self.max_model_len:
            raise ValueError(
                f"request {rid!r} has {request.num_tokens} tokens; need 1 <= tokens < "
                f"max_model_len ({self.max_model_len}) to generate anything"
            )
        # the last token is sampled but never cached
        max_cached = min(self.max_model_len, request.num_tokens + params.max_tokens) - 1
        if not self.cache.can_ever_fit(max_cached):
            raise ValueError(
                f"request {rid!r} can need {max_cached} cached tokens; the whole cache holds "
                f"fewer ({self.cache.stats().num_blocks} blocks of "
                f"{self.cache.tokens_per_block} tokens, cp_size={self.cache.cp_size})"
            )
        self._add_stop_checker(request)
        self._requests[rid] = request
        self.waiting.append(request)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._requests or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in the scheduler")

    def _add_stop_checker(self, request: Request) -> None:
        stop = request.sampling_params.stop
        if stop:
            if self.detokenize is None:
                raise ValueError(f"request {request.request_id!r} has stop strings but no "
                                 "detokenize was given")
            self._stop_checkers[request.request_id] = StopChecker(stop, self.detokenize)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Finish a request (ABORTED, or ERROR when ``error`` is given) and free its cache.

        Returns False when the id is unknown or already finished (a cancel racing a finish).
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        request.error = error
        self._finish(request, status)
        return True

    def release(self, request_id: str) -> bool:
        """Free the cache of a held request; False when ``request_id`` is not held."""
        if self._held.pop(request_id, None) is None:
            return False
        self.cache.free(request_id)
        return True

    def fail_pending_step(self, error: str) -> list[str]:
        """Forget the scheduled step(s) whose output will never come (the model raised): their
        live requests finish with ``error`` (their computed counts no longer match the cache), or
        every unfinished one when none was scheduled (scheduling itself failed); their ids."""
        if self._pending is not None:
            request_ids = [rid for rid in self._pending_requests if self._is_live(rid)]
        else:
            request_ids = list(self._requests)
        for rid in request_ids:
            self.abort(rid, error=error)
        self._pending, self._pending_requests = None, {}
        self._ahead, self._ahead_requests = None, {}
        self._in_flight.clear()
        self._free_deferred()
        return request_ids

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def can_add_prefilled(self) -> bool:
        """Whether a prefilled request can start decoding now (a free running slot)."""
        return len(self.running) < self.max_num_seqs

    def add_prefilled(self, request: Request) -> list[RequestUpdate]:
        """Start decoding a request whose prompt is already in the cache (a KV transfer filled the
        handle ``cache`` holds for it), from its ``forced_output_token_ids`` (the ctx worker's
        first tokens); returns their updates (they count as generated tokens).

        Raises ``ValueError`` when it cannot start: no cache handle, no first token, no running
        slot (check ``can_add_prefilled``), or limits it already breaks.
        """
        rid, params = request.request_id, request.sampling_params
        first = list(request.forced_output_token_ids)
        self._check_new_id(rid)
        if not first or request.output_token_ids or request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} must be new with >= 1 forced first token")
        num_cached = request.num_prompt_tokens + len(first) - 1
        if rid not in self.cache or self.cache.get(rid).num_tokens < num_cached:
            raise ValueError(f"request {rid!r} has no cache handle covering its {num_cached} cached tokens")
        if not self.can_add_prefilled():
            raise ValueError(f"request {rid!r}: all {self.max_num_seqs} running slots are taken")
        if len(first) >= params.max_tokens or request.num_prompt_tokens + len(first) >= self.max_model_len:
            raise ValueError(f"request {rid!r} is already finished after its {len(first)} first tokens")
        self._add_stop_checker(request)
        request.output_token_ids = first
        request.num_computed_tokens = num_cached  # the last first token is not cached yet
        request.status = RequestStatus.RUNNING
        self._requests[rid] = request
        self.running.append(request)
        return [RequestUpdate(rid, token, RequestStatus.RUNNING) for token in first]

    # -- step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's work. Strictly alternates with ``update_from_output``."""
        if self._pending is not None:
            raise RuntimeError("schedule() called before update_from_output() of the last step")
        out = self._schedule()
        self._pending = out if out.seqs else None
        self._pending_requests = {s.request_id: self._requests[s.request_id] for s in out.seqs}
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The decode step after the pending one, scheduled before its tokens are known, so the
        device runs it while the host applies them (overlapped decoding). Only in the steady
        state: the pending step samples every running request (a decode or a prompt's last chunk),
        no waiting request could be admitted now (a full server still overlaps; one freed by the
        pending step is admitted a step later), and no request holds its cache on finish (a ctx
        prefill), has forced tokens left or reaches ``max_model_len``.
        The input tokens are the pending step's samples, fed on the device (``token_ids`` hold
        ``-1``). A request finishing with the pending token runs here too: its output is dropped
        and its cache freed once this step is updated (the device may still write it). ``None``
        when not possible; caches may stay extended by one token, which the next step needs.
        """
        out = self._pending
        if out is None or self._ahead is not None or len(out.seqs) != len(self.running):
            return None
        if self.waiting and self._can_admit(self.waiting[0]):
            return None  # a plain step admits it now
        requests = self._pending_requests
        ahead = SchedulerOutput()
        for seq in out.seqs:
            request = requests[seq.request_id]
            if (not seq.sample or request.hold_cache_on_finish
                    or len(request.forced_output_token_ids) > request.num_output_tokens
                    or request.num_tokens + 1 >= self.max_model_len
                    or request is not self._requests.get(seq.request_id)):
                return None
            handle = self.cache.get(request.request_id)
            if not self.cache.try_extend(handle, request.num_tokens + 1):
                return None
            ahead.seqs.append(self._seq(request, [-1], is_prefill=False, sample=True, ahead=len(seq.token_ids)))
        self._ahead, self._ahead_requests = ahead, dict(requests)
        self._in_flight.update(requests)
        return ahead

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens - self._schedule_decodes(out)
        for request in self.running:
            if budget == 0:
                break
            if not self._is_decode(request):
                budget -= self._schedule_chunk(request, budget, out)
        if out.preempted_ids:
            return out
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._can_admit(request):
                break  # back-pressure
            self.cache.allocate(request.request_id, request.num_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= self._schedule_chunk(request, budget, out)
        return out

    def _can_admit(self, request: Request) -> bool:
        """A free sequence slot and cache for the whole prompt of the head of ``waiting``."""
        return len(self.running) < self.max_num_seqs and self.cache.can_allocate(request.num_tokens)

    @staticmethod
    def _is_decode(request: Request) -> bool:
        outputs = len(request.output_token_ids)  # (the properties, inlined: once per request per step)
        return outputs > 0 and request.num_computed_tokens == len(request.prompt_token_ids) + outputs - 1

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        num_scheduled = 0
        index = 0
        while index < len(self.running):
            request = self.running[index]
            if not self._is_decode(request):
                index += 1
                continue
            handle = self.cache.get(request.request_id)
            while not self.cache.try_extend(handle, request.num_tokens):
                victim = self.running[-1]  # index <= last, so never an already-scheduled one
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    return num_scheduled
            out.seqs.append(self._seq(request, [request.output_token_ids[-1]], is_prefill=False, sample=True))
            num_scheduled += 1
            index += 1
        return num_scheduled

    def _schedule_chunk(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        start = request.num_computed_tokens
        stop = min(request.num_tokens, start + budget)
        token_ids = request.token_ids_between(start, stop)
        is_last = stop == request.num_tokens
        out.seqs.append(self._seq(request, token_ids, is_prefill=True, sample=is_last))
        return stop - start

    def _seq(
        self, request: Request, token_ids: list[int], is_prefill: bool, sample: bool, ahead: int = 0
    ) -> ScheduledSeq:
        """``ahead``: tokens computed by steps not yet updated (1 for a step scheduled ahead)."""
        handle = self.cache.get(request.request_id)
        return ScheduledSeq(request.request_id, token_ids, request.num_computed_tokens + ahead, handle.block_table(),
                            handle.slot, is_prefill, sample)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free_cache(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- postprocess ---------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish and free stopped requests.

        ``sampled_token_ids`` must hold a token for every seq with ``sample=True``. Seqs of
        requests aborted since ``schedule()`` are skipped.
        """
        if output is not self._pending and output.seqs:
            raise ValueError("update_from_output() got an output that is not the pending step")
        live = [(seq, self._requests[seq.request_id]) for seq in output.seqs if self._is_live(seq.request_id)]
        missing = [seq.request_id for seq, _ in live if seq.sample and seq.request_id not in sampled_token_ids]
        if missing:
            raise ValueError(f"no sampled token for requests {missing}")
        updates: list[RequestUpdate] = []
        for seq, request in live:
            request.num_computed_tokens += len(seq.token_ids)
            if not seq.sample:
                continue
            token = request.next_output_token(sampled_token_ids[seq.request_id])
            request.output_token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request.request_id, token, request.status))
        self._pending, self._pending_requests = self._ahead, self._ahead_requests
        self._ahead, self._ahead_requests = None, {}
        if self._deferred_frees or self._in_flight:
            self._in_flight = set(self._pending_requests) if self._pending is not None else set()
            self._free_deferred()
        return updates

    def _free_cache(self, request_id: str) -> None:
        if request_id in self._in_flight:
            self._deferred_frees.append(request_id)
        else:
            self.cache.free(request_id)

    def _free_deferred(self) -> None:
        for rid in self._deferred_frees:
            if rid not in self._in_flight:
                self.cache.free(rid)
        self._deferred_frees = [rid for rid in self._deferred_frees if rid in self._in_flight]

    def _is_live(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request is self._pending_requests.get(request_id)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in self.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        checker = self._stop_checkers.get(request.request_id)
        if checker is not None:
            matched = checker.check(request.output_token_ids)
            if matched is not None:
                request.stop_reason = matched
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            keep = request.hold_cache_on_finish and status in _HOLDABLE
            if keep:
                self._held[request.request_id] = request
            else:
                self._free_cache(request.request_id)
        request.status = status
        del self._requests[request.request_id]
        self._stop_checkers.pop(request.request_id, None)
