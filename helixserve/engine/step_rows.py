"""A request's row in a step (torch-free): the :class:`ScheduledSeq` for a decode, a prompt chunk
or a decode scheduled ahead, with its context length and block table.

Only the final chunk of a prefill is sampled. With prefix caching a chunk takes the KDA state
checkpoints of the positions it covers (:mod:`helixserve.engine.prefix_steps`) without stopping
there. With batch
invariance (``model.deterministic``) a prompt's chunks end at multiples of a fixed unit, so the
same prompt is split alike whatever it is batched with (a chunk boundary changes the bits of the
KDA recurrence and of the MLA prefill).
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


def chunk_stop(request: Request, budget: int, chunk_unit: int | None) -> int:
    """Where the request's next prompt chunk ends: ``budget`` tokens on, or with ``chunk_unit``
    (batch-invariant prefill) at the next multiple of it, whatever the step's other rows; 0 when
    that aligned chunk does not fit in ``budget`` (it waits for a step with room)."""
    start = request.num_computed_tokens
    if chunk_unit is None:
        return min(request.num_tokens, start + budget)
    stop = min(request.num_tokens, (start // chunk_unit + 1) * chunk_unit)
    return stop if stop - start <= budget else 0


def schedule_chunk(cache: CacheManager, request: Request, budget: int, out: SchedulerOutput,
                   chunk_unit: int | None = None) -> int:
    """Append the request's next prompt chunk (at most ``budget`` tokens; see :func:`chunk_stop`);
    its token count (0: none this step)."""
    start = request.num_computed_tokens
    stop = chunk_stop(request, budget, chunk_unit)
    if stop == 0:
        return 0
    plan = plan_chunk(cache, request, start, stop)
    token_ids = request.token_ids_between(start, plan.stop)
    seq = scheduled_seq(cache, request, token_ids, is_prefill=True, sample=plan.stop == request.num_tokens)
    seq.restore_checkpoint, seq.save_checkpoint = plan.restore_checkpoint, plan.save_checkpoint
    seq.inner_saves = tuple((position - start, checkpoint) for position, checkpoint in plan.inner_saves)
    out.seqs.append(seq)
    return plan.stop - start


def scheduled_seq(
    cache: CacheManager, request: Request, token_ids: list[int], is_prefill: bool, sample: bool, ahead: int = 0
) -> ScheduledSeq:
    """``ahead``: tokens computed by steps not yet updated (1 for a step scheduled ahead)."""
    handle = cache.get(request.request_id)
    return ScheduledSeq(request.request_id, token_ids, request.num_computed_tokens + ahead, handle.block_table(),
                        handle.slot, is_prefill, sample)
