"""Decode rows and recompute preemption (torch-free): stage 1 of ``Scheduler.schedule``.

Every running request that is decoding gets its one token (the last sampled one). If its cache
cannot grow, the most recently admitted running request is preempted (cache freed, requeued at
the front of ``waiting`` with nothing computed, to be recomputed from scratch: prompt + outputs
so far) until it can. A step that preempted admits nobody. A speculating request's drafts
(:mod:`helixserve.engine.spec.drafting`) follow its token when its cache can hold them; when it
cannot, it decodes one token as any other (and may preempt for that).
"""

from __future__ import annotations

from collections import deque

from helixserve.engine.cache_release import CacheReleases
from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.engine.spec.drafting import Drafter
from helixserve.engine.step_rows import is_decode, scheduled_seq


def schedule_decodes(
    running: list[Request], waiting: deque[Request], releases: CacheReleases, out: SchedulerOutput,
    drafter: Drafter | None = None, draft_budget: int = 0,
) -> int:
    """Append a decode row for each decoding request of ``running`` (admission order),
    preempting from its end as needed; the number of rows appended. With a ``drafter``, a
    request whose cache can also hold its drafts (within ``draft_budget`` tokens over the whole
    step) gets them after its token, a verify row each."""
    cache = releases.cache
    num_rows = 0
    index = 0
    while index < len(running):
        request = running[index]
        if not is_decode(request):
            index += 1
            continue
        handle = cache.get(request.request_id)
        drafts = drafter.propose(request, draft_budget) if drafter is not None else []
        if drafts and not cache.try_extend(handle, request.num_tokens + len(drafts)):
            drafts = []
        while not drafts and not cache.try_extend(handle, request.num_tokens):
            victim = running[-1]  # index <= last, so never an already-scheduled one
            preempt(victim, running, waiting, releases)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return num_rows
        seq = scheduled_seq(cache, request, [request.output_token_ids[-1], *drafts], is_prefill=False, sample=True)
        seq.num_draft_tokens = len(drafts)
        out.seqs.append(seq)
        draft_budget -= len(drafts)
        num_rows += 1 + len(drafts)
        index += 1
    return num_rows


def preempt(request: Request, running: list[Request], waiting: deque[Request], releases: CacheReleases) -> None:
    """Free the request's cache and requeue it at the front of ``waiting``, nothing computed."""
    running.remove(request)
    releases.free(request.request_id)
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    waiting.appendleft(request)
