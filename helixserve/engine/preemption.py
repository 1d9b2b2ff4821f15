"""Decode rows and recompute preemption (torch-free): stage 1 of ``Scheduler.schedule``.

Every running request that is decoding gets its one token (the last sampled one). If its cache
cannot grow, the most recently admitted running request is preempted (cache freed, requeued at
the front of ``waiting`` with nothing computed, to be recomputed from scratch: prompt + outputs
so far) until it can. A step that preempted admits nobody.
"""

from __future__ import annotations

from collections import deque

from helixserve.engine.cache_release import CacheReleases
from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.engine.step_rows import is_decode, scheduled_seq


def schedule_decodes(
    running: list[Request], waiting: deque[Request], releases: CacheReleases, out: SchedulerOutput
) -> int:
    """Append a decode row for each decoding request of ``running`` (admission order),
    preempting from its end as needed; the number of rows appended."""
    cache = releases.cache
    num_scheduled = 0
    index = 0
    while index < len(running):
        request = running[index]
        if not is_decode(request):
            index += 1
            continue
        handle = cache.get(request.request_id)
        while not cache.try_extend(handle, request.num_tokens):
            victim = running[-1]  # index <= last, so never an already-scheduled one
            preempt(victim, running, waiting, releases)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return num_scheduled
        out.seqs.append(scheduled_seq(cache, request, [request.output_token_ids[-1]], is_prefill=False, sample=True))
        num_scheduled += 1
        index += 1
    return num_scheduled


def preempt(request: Request, running: list[Request], waiting: deque[Request], releases: CacheReleases) -> None:
    """Free the request's cache and requeue it at the front of ``waiting``, nothing computed."""
    running.remove(request)
    releases.free(request.request_id)
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    waiting.appendleft(request)
