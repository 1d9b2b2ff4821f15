"""Overlapped decoding's look-ahead (torch-free): the rules of ``Scheduler.schedule_ahead``.

The decode step after the pending one is scheduled before its tokens are known, so the device
runs it while the host applies them. Only in the steady state:

- the pending step samples every running request (a decode or a prompt's last chunk), and no
  waiting request could be admitted now (a full server still overlaps; one freed by the pending
  step is admitted a step later) — checked by the scheduler;
- no request holds its cache on finish (a ctx prefill), has forced tokens left or reaches
  ``max_model_len``, and each request's cache can grow by the one token — checked here;
- with speculative decoding, no request would draft on its tokens so far (an ahead step carries
  no drafts; ``Drafter.would_draft``) — checked by the scheduler.

The input tokens are the pending step's samples, fed on the device (``token_ids`` hold ``-1``).
A request finishing with the pending token runs here too: its output is dropped and its cache
freed once this step is updated (the device may still write it; see
:mod:`helixserve.engine.cache_release`). When not possible, caches may stay extended by one
token, which the next step needs.
"""

from __future__ import annotations

from collections.abc import Mapping

from helixserve.engine.request import Request
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.engine.step_rows import scheduled_seq
from helixserve.kvcache.manager import CacheManager


def build_ahead(
    pending: SchedulerOutput,
    pending_requests: Mapping[str, Request],
    live_requests: Mapping[str, Request],
    cache: CacheManager,
    max_model_len: int,
) -> SchedulerOutput | None:
    """The step after ``pending`` (whose requests are ``pending_requests``; ``live_requests`` the
    scheduler's unfinished ones), or ``None`` when a request of it cannot run ahead."""
    ahead = SchedulerOutput()
    for seq in pending.seqs:
        request = pending_requests[seq.request_id]
        if not can_run_ahead(seq, request, live_requests, max_model_len):
            return None
        handle = cache.get(request.request_id)
        if not cache.try_extend(handle, request.num_tokens + 1):
            return None
        ahead.seqs.append(scheduled_seq(cache, request, [-1], is_prefill=False, sample=True, ahead=len(seq.token_ids)))
    return ahead


def can_run_ahead(
    seq: ScheduledSeq, request: Request, live_requests: Mapping[str, Request], max_model_len: int
) -> bool:
    """Whether the request of pending ``seq`` may run one more decode before it is updated."""
    return not (not seq.sample or request.hold_cache_on_finish
                or len(request.forced_output_token_ids) > request.num_output_tokens
                or request.num_tokens + 1 >= max_model_len
                or request is not live_requests.get(seq.request_id))
