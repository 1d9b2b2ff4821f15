"""helixserve.ctx_server: the context (prefill) worker.

A ``context_only`` request passes these stages, each a named queue:

1. **Admission** (:class:`~helixserve.engine.async_engine.AsyncEngine`): parsed, tokenized (chat
   template for chat), checked against the context length; at most ``max_num_seqs +
   max_queue_len`` live requests, else 429.
2. **PREFILLING** (the engine's ``Scheduler.waiting`` then ``Scheduler.running``): the prompt is
   prefilled (chunked under the token budget) and the first token sampled; the request runs with
   ``max_tokens=1`` and ``hold_cache=True``, so finishing keeps its blocks and state slot. An id
   already alive here is refused (400 ``duplicate_request_id``) before it reaches the engine.
3. **HELD**, then **SENDING** once the KV sender of :mod:`~helixserve.ctx_server.transfer` took
   it: the answer carries ``disaggregated_params`` (ctx_request_id, first_gen_tokens,
   prompt_token_ids, the transceiver endpoint, the KV layout) and the cache stays pinned while the
   gen ranks pick their shards up over UCX.
4. **RELEASED** by the KV sender: when every expected gen rank acknowledged its shard, on cancel
   (``POST /v1/abort``: client gone; ``POST /v1/release``: the router is done, e.g. with a gen
   worker that recomputes) or when the hold deadline passes (counted as expired), and only
   once no send can still read the blocks. A request that already finished at its first token
   (stop, or ``max_tokens == 1``) is freed at once and answered with its final text.

These states live in one table, :class:`~helixserve.ctx_server.lifecycle.CtxRequestLife`, moved
by typed events on the engine thread (:class:`~helixserve.ctx_server.ctx_requests.CtxRequests`).

Requests without ``disaggregated_params`` run aggregated here (prefill and decode).
"""
