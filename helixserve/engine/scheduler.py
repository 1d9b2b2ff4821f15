"""Continuous-batching scheduler with chunked prefill and recompute preemption (torch-free).

Each ``schedule()`` step, under a token budget of ``max_num_batched_tokens``:

1. every running request that is decoding gets its one token (the last sampled one); if its
   cache cannot grow, the most recently admitted running request is preempted (cache freed,
   requeued at the front of ``waiting`` to be recomputed from scratch) until it can
   (:mod:`helixserve.engine.preemption`);
2. running requests still in a chunked prefill get their next chunk
   (:mod:`helixserve.engine.step_rows`: only the final chunk of a prefill is sampled);
3. unless something was preempted this step, waiting requests are admitted FCFS while there are
   sequence slots, budget and cache for their whole prompt (back-pressure: the head of the queue
   waits, nobody jumps it; :mod:`helixserve.engine.admission`).

With a ``drafter`` (speculative decoding, :mod:`helixserve.engine.spec.drafting`) a decoding
request's row carries its draft tokens after its last sampled one, counted against the budget.

``update_from_output`` appends the sampled tokens (or verified runs), applies the stop rules
(:func:`helixserve.engine.stop.stop_status`: eos unless ``ignore_eos``, ``stop_token_ids``, stop
strings through a ``detokenize`` callable, ``max_tokens``, ``max_model_len``) and frees finished
requests' caches; a request whose stop rules raise ends alone with the error. ``schedule_ahead`` schedules the next decode step before the pending one's
tokens are known (overlapped decoding; its rules: :mod:`helixserve.engine.lookahead`).

A request with ``hold_cache_on_finish`` (a ctx worker's prefill awaiting its gen worker) that finishes by
stop or length keeps its cache, *held*, until ``release(request_id)``; an abort or error frees at
once. Held caches and frees deferred past a step scheduled ahead:
:mod:`helixserve.engine.cache_release`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from helixserve.engine.admission import can_admit, check_new_request, check_prefilled_request, has_free_slot
from helixserve.engine.cache_release import CacheReleases
from helixserve.engine.lookahead import build_ahead
from helixserve.engine.prefix_steps import admit, commit_computed, exclude_received, prefix_hit
from helixserve.engine.preemption import schedule_decodes
from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.scheduler_output import RequestUpdate, ScheduledSeq, SchedulerOutput
from helixserve.engine.spec.accept import append_verified_tokens
from helixserve.engine.spec.drafting import Drafter
from helixserve.engine.step_rows import chunk_stop, is_decode, schedule_chunk
from helixserve.engine.stop import Detokenize, StopChecker, stop_checker_for
from helixserve.kvcache.manager import CacheManager

__all__ = ["RequestUpdate", "ScheduledSeq", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(
        self,
        cache_manager: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        detokenize: Detokenize | None = None,
        drafter: Drafter | None = None,
        aligned_chunks: bool = False,
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
        self.drafter = drafter
        # batch-invariant prefill: chunks end at multiples of a unit that always fits beside a full
        # set of decode rows (with their drafts), so the first prompt chunk of a step always runs
        decode_rows = max_num_seqs * (1 + (drafter.num_draft_tokens if drafter is not None else 0))
        self.chunk_unit = max(1, max_num_batched_tokens - decode_rows) if aligned_chunks else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; preemption takes from the end
        self._requests: dict[str, Request] = {}
        self._stop_checkers: dict[str, StopChecker] = {}
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._pending_requests: dict[str, Request] = {}
        self._ahead: SchedulerOutput | None = None  # see schedule_ahead
        self._ahead_requests: dict[str, Request] = {}
        self._releases = CacheReleases(cache_manager)  # held caches, frees deferred past a step ahead

    # -- queue -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ``ValueError`` for one that could never run."""
        self.check_new_id(request.request_id)
        check_new_request(request, self.max_model_len, self.cache)
        self._add_stop_checker(request)
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def check_new_id(self, request_id: str) -> None:
        if request_id in self._requests or self._releases.is_held(request_id):
            raise ValueError(f"request id {request_id!r} is already in the scheduler")

    def _add_stop_checker(self, request: Request) -> None:
        checker = stop_checker_for(request.request_id, request.sampling_params.stop, self.detokenize)
        if checker is not None:
            self._stop_checkers[request.request_id] = checker

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
        return self._releases.release(request_id)

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
        self._releases.clear_in_flight()
        return request_ids

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    def is_held(self, request_id: str) -> bool:
        """Whether ``request_id`` finished with its cache held (until ``release``)."""
        return self._releases.is_held(request_id)

    @property
    def num_held(self) -> int:
        return self._releases.num_held

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
        return has_free_slot(len(self.running), self.max_num_seqs)

    def add_prefilled(self, request: Request) -> list[RequestUpdate]:
        """Start decoding a request whose prompt is already in the cache (a KV transfer filled the
        handle ``cache`` holds for it), from its ``forced_output_token_ids`` (the ctx worker's
        first tokens); returns their updates (they count as generated tokens).

        Raises ``ValueError`` when it cannot start: no cache handle, no first token, no running
        slot (check ``can_add_prefilled``), or limits it already breaks.
        """
        rid = request.request_id
        first = list(request.forced_output_token_ids)
        self.check_new_id(rid)
        check_prefilled_request(request, self.max_model_len, self.cache, len(self.running), self.max_num_seqs)
        self._add_stop_checker(request)
        exclude_received(self.cache, request)
        request.output_token_ids = first
        request.num_computed_tokens = request.num_prompt_tokens + len(first) - 1  # the last first token is not cached yet
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
        device runs it while the host applies them (overlapped decoding); ``None`` when not
        possible. The rules: :mod:`helixserve.engine.lookahead`.
        """
        out = self._pending
        if out is None or self._ahead is not None or len(out.seqs) != len(self.running):
            return None
        head = self.waiting[0] if self.waiting else None
        if head and can_admit(head, len(self.running), self.max_num_seqs, self.cache, prefix_hit(self.cache, head)):
            return None  # a plain step admits it now
        requests = self._pending_requests
        if self.drafter is not None and any(self.drafter.would_draft(r) for r in requests.values()):
            return None  # its drafts need the pending token: it runs after it, drafted
        ahead = build_ahead(out, requests, self._requests, self.cache, self.max_model_len)
        if ahead is None:
            return None
        self._ahead, self._ahead_requests = ahead, dict(requests)
        self._releases.add_in_flight(requests)
        return ahead

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        draft_budget = 0
        if self.drafter is not None:
            draft_budget = self.max_num_batched_tokens - sum(map(is_decode, self.running))
        budget = self.max_num_batched_tokens - schedule_decodes(
            self.running, self.waiting, self._releases, out, self.drafter, draft_budget)
        for request in self.running:
            if budget == 0:
                break
            if not is_decode(request):
                budget -= schedule_chunk(self.cache, request, budget, out, self.chunk_unit)
        if out.preempted_ids:
            return out
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if chunk_stop(request, budget, self.chunk_unit) == 0:
                break  # its aligned first chunk needs a step with more room
            hit = prefix_hit(self.cache, request)
            if not can_admit(request, len(self.running), self.max_num_seqs, self.cache, hit):
                break  # back-pressure
            admit(self.cache, request, hit)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= schedule_chunk(self.cache, request, budget, out, self.chunk_unit)
        return out

    # -- postprocess ---------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int | Sequence[int]]
    ) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish and free stopped requests.

        ``sampled_token_ids`` must hold a token for every seq with ``sample=True``: one token, or
        a speculating seq's verified run (its accepted drafts, then the correction or bonus
        token), appended through :func:`~helixserve.engine.spec.accept.append_verified_tokens`
        (one token is the one-token run); one update per appended token. A speculating seq's
        computed count advances by the tokens appended, and the blocks only its rejected drafts
        took go back. Seqs of requests aborted since ``schedule()`` are skipped.
        """
        if output is not self._pending and output.seqs:
            raise ValueError("update_from_output() got an output that is not the pending step")
        live = [(seq, self._requests[seq.request_id]) for seq in output.seqs if self._is_live(seq.request_id)]
        missing = [seq.request_id for seq, _ in live if seq.sample and seq.request_id not in sampled_token_ids]
        if missing:
            raise ValueError(f"no sampled token for requests {missing}")
        updates: list[RequestUpdate] = []
        for seq, request in live:
            if not seq.sample:
                request.num_computed_tokens += len(seq.token_ids)
                commit_computed(self.cache, request)
                continue
            sampled = sampled_token_ids[seq.request_id]
            updates.extend(self._append_run(seq, request, [sampled] if isinstance(sampled, int) else sampled))
        self._pending, self._pending_requests = self._ahead, self._ahead_requests
        self._ahead, self._ahead_requests = None, {}
        self._releases.step_updated(self._pending_requests if self._pending is not None else ())
        return updates

    def _append_run(self, seq: ScheduledSeq, request: Request, run: Sequence[int]) -> list[RequestUpdate]:
        first = len(request.output_token_ids)
        try:
            appended = append_verified_tokens(request, run, self.eos_token_ids,
                                              self._stop_checkers.get(request.request_id), self.max_model_len)
            status, num_appended = appended.status, appended.num_appended
        except Exception as exc:  # noqa: BLE001 - its stop rules (a detokenizer) failed: it alone ends
            request.error = f"stop rules failed: {type(exc).__name__}: {exc}"
            status, num_appended = RequestStatus.FINISHED_ERROR, len(request.output_token_ids) - first
        request.num_computed_tokens += num_appended if seq.num_draft_tokens else len(seq.token_ids)
        commit_computed(self.cache, request)
        if status is not None:
            self._finish(request, status)
        elif seq.num_draft_tokens:
            self.cache.shrink(self.cache.get(request.request_id), request.num_computed_tokens)
        tokens = request.output_token_ids[first:]
        return [RequestUpdate(request.request_id, token, RequestStatus.RUNNING) for token in tokens[:-1]] + [
            RequestUpdate(request.request_id, tokens[-1] if tokens else -1, request.status, error=request.error,
                          num_cached_tokens=request.num_cached_tokens)]

    def _is_live(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request is self._pending_requests.get(request_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._releases.finish(request, status)
        request.status = status
        del self._requests[request.request_id]
        self._stop_checkers.pop(request.request_id, None)
