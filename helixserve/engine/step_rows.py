"""A request's row in a step (torch-free): the :class:`ScheduledSeq` for a decode, a prompt chunk
or a decode scheduled ahead, with its context length and block table.

Only the final chunk of a prefill is sampled. With prefix caching a chunk may stop short of the
budget, at a KDA state checkpoint position (:mod:`helixserve.engine.prefix_steps`).
"""

from __future__ import annotations

from helixserve.engine.prefix_steps import plan_chunk
from helixserve.engine.request import Request
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.kvcache.manager import CacheManager


def is_decode(request: Request) -> bool:
    """Its prompt and every output but the last sampled one are in the cache."""
    outputs = len(request.output_token_ids)  # (the properties, inlined: once per request per step)
    return outputs > 0 and request.num_computed_tokens == len(request.prompt_token_ids) + outputs - 1


def schedule_chunk(cache: CacheManager, request: Request, budget: int, out: SchedulerOutput) -> int:
    """Append the request's next prompt chunk (at most ``budget`` tokens); its token count."""
    start = request.num_computed_tokens
    plan = plan_chunk(cache, request, start, min(request.num_tokens, start + budget))
    token_ids = request.token_ids_between(start, plan.stop)
    seq = scheduled_seq(cache, request, token_ids, is_prefill=True, sample=plan.stop == request.num_tokens)
    seq.restore_checkpoint, seq.save_checkpoint = plan.restore_checkpoint, plan.save_checkpoint
    out.seqs.append(seq)
    return plan.stop - start


def scheduled_seq(
    cache: CacheManager, request: Request, token_ids: list[int], is_prefill: bool, sample: bool, ahead: int = 0
) -> ScheduledSeq:
    """``ahead``: tokens computed by steps not yet updated (1 for a step scheduled ahead)."""
    handle = cache.get(request.request_id)
    return ScheduledSeq(request.request_id, token_ids, request.num_computed_tokens + ahead, handle.block_table(),
                        handle.slot, is_prefill, sample)
