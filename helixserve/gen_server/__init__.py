"""helixserve.gen_server: the generation (decode) worker, on gen rank 0 of a dp x cp world.

A ``generation_only`` request passes these stages, each a named queue:

1. **Admission** (:class:`~helixserve.engine.async_engine.AsyncEngine`): parsed; its prompt is the
   ctx-given ``prompt_token_ids``; the ctx :class:`~helixserve.protocol.KVLayout` must match this
   worker's (400 naming the fields otherwise); at most ``max_num_seqs + max_queue_len`` live
   requests, else 429.
2. **KV pickup** (:class:`~helixserve.gen_server.kv_source.KVSource`): the request's prompt state
   enters this engine's cache. The transceiver's receiver will fill the preallocated blocks and
   slots (bounded polling, CP-group consensus); until it lands, :class:`RecomputeKVSource`
   re-prefills ``prompt_token_ids`` here, a documented fallback that is *not* the data path.
3. **Decode** (the engine's ``Scheduler.running``): starts from ``first_gen_tokens`` (the ctx's
   sampled token is forced, so outputs equal an aggregated run's, seeded sampling included).
4. **Stream out**: every output token (``first_gen_tokens`` included) goes back as SSE or one
   answer; a client that leaves (the router cancels with ``POST /v1/abort``) frees the cache.

Requests without ``disaggregated_params`` run aggregated here (prefill and decode): the baseline
that disaggregated answers must equal.
"""
