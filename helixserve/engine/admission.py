"""Which requests may enter the scheduler, and when a waiting one is admitted (torch-free).

- ``check_new_request``: a request for ``Scheduler.add_request`` that could never run (too long
  for ``max_model_len``, more cache than the whole cache holds) raises ``ValueError`` at once.
- ``check_engine_request``: what an engine checks first of any request (token ids in the
  vocabulary, forced tokens within ``max_tokens``, stop strings need a tokenizer, a received
  cache needs a receiving engine and its first tokens), then ``check_new_request``.
- ``check_prefilled_request``: a request for ``Scheduler.add_prefilled`` (its prompt already in
  the cache through a KV transfer) needs its cache handle, a forced first token and a free slot.
- ``can_admit``: the head of ``waiting`` is admitted FCFS when there is a free sequence slot and
  cache for its whole prompt (back-pressure: the head waits, nobody jumps it).
"""

from __future__ import annotations

from helixserve.engine.request import Request, RequestStatus
from helixserve.kvcache.manager import NO_HIT, CacheManager, PrefixHit


def check_new_request(request: Request, max_model_len: int, cache: CacheManager) -> None:
    """Raises ``ValueError`` for a request that is not new or could never run."""
    rid, params = request.request_id, request.sampling_params
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed)")
    if not 1 <= request.num_tokens < max_model_len:
        raise ValueError(
            f"request {rid!r} has {request.num_tokens} tokens; need 1 <= tokens < "
            f"max_model_len ({max_model_len}) to generate anything"
        )
    # the last token is sampled but never cached
    max_cached = min(max_model_len, request.num_tokens + params.max_tokens) - 1
    if not cache.can_ever_fit(max_cached):
        raise ValueError(
            f"request {rid!r} can need {max_cached} cached tokens; the whole cache holds "
            f"fewer ({cache.stats().num_blocks} blocks of "
            f"{cache.tokens_per_block} tokens, cp_size={cache.cp_size})"
        )


def check_engine_request(request: Request, vocab_size: int, max_model_len: int, cache: CacheManager, *,
                         can_detokenize: bool, has_kv: bool, receives_kv: bool) -> None:
    """Raises ``ValueError`` for a request an engine could never run (see the module docstring)."""
    params, forced = request.sampling_params, request.forced_output_token_ids
    bad = [t for t in (*request.prompt_token_ids, *forced) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:8]}")
    if len(forced) > params.max_tokens:
        raise ValueError(f"{len(forced)} forced output tokens exceed max_tokens={params.max_tokens}")
    check_new_request(request, max_model_len, cache)
    if params.stop and not can_detokenize:
        raise ValueError("request has stop strings but the engine has no tokenizer")
    if has_kv:
        if not receives_kv:
            raise ValueError("this engine receives no prompt caches (not a gen world)")
        if not 1 <= len(forced) < params.max_tokens:
            raise ValueError(f"a request with received KV needs 1 <= len(first_gen_tokens) < "
                             f"max_tokens={params.max_tokens}, got {len(forced)}")


def check_prefilled_request(
    request: Request, max_model_len: int, cache: CacheManager, num_running: int, max_num_seqs: int
) -> None:
    """Raises ``ValueError`` when a prefilled request cannot start decoding now: no cache handle,
    no first token, no running slot, or limits it already breaks."""
    rid, params = request.request_id, request.sampling_params
    first = request.forced_output_token_ids
    if not first or request.output_token_ids or request.status is not RequestStatus.WAITING:
        raise ValueError(f"request {rid!r} must be new with >= 1 forced first token")
    num_cached = request.num_prompt_tokens + len(first) - 1
    if rid not in cache or cache.get(rid).num_tokens < num_cached:
        raise ValueError(f"request {rid!r} has no cache handle covering its {num_cached} cached tokens")
    if not has_free_slot(num_running, max_num_seqs):
        raise ValueError(f"request {rid!r}: all {max_num_seqs} running slots are taken")
    if len(first) >= params.max_tokens or request.num_prompt_tokens + len(first) >= max_model_len:
        raise ValueError(f"request {rid!r} is already finished after its {len(first)} first tokens")


def has_free_slot(num_running: int, max_num_seqs: int) -> bool:
    return num_running < max_num_seqs


def can_admit(request: Request, num_running: int, max_num_seqs: int, cache: CacheManager,
              hit: PrefixHit = NO_HIT) -> bool:
    """A free sequence slot and cache for the whole prompt of the head of ``waiting`` (``hit``:
    its cached prefix)."""
    return has_free_slot(num_running, max_num_seqs) and cache.can_allocate(request.num_tokens, hit)
