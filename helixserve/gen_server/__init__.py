"""helixserve.gen_server: the generation (decode) worker, on gen rank 0 of a dp x cp world.

A ``generation_only`` request passes these stages, each a named queue:

1. **Admission** (:class:`~helixserve.engine.async_engine.AsyncEngine`): parsed; its prompt is the
   ctx-given ``prompt_token_ids``; the ctx :class:`~helixserve.protocol.KVLayout` must match this
   worker's (400 naming the fields otherwise); at most ``dp * max_num_seqs + max_queue_len`` live
   requests, else 429.
2. **KV intake** (:class:`~helixserve.gen_server.kv_source.KVSource`): the request's prompt state
   enters the cache. :class:`~.kv_source.UcxKVSource` (``kv_source: ucx``, the default): the
   request waits in :class:`~helixserve.serving.world_core.WorldCore` until its shard fits, then rank 0 assigns it to
   a CP group (attention DP), every rank of that group allocates its shard and its receiver asks
   the ctx worker's KV sender for exactly that shard over UCX; each executor step polls (bounded)
   and the group's ranks agree (``transceiver.consensus``, one all-gather over the CP group): the
   request starts once every rank of the group has its shard, or fails on every rank (503 / 504
   naming the ctx worker, the rank and the cause) when one failed or timed out. :class:`~.kv_source.RecomputeKVSource` (``recompute``) re-prefills instead: a
   fallback, not the data path.
3. **Decode** (the world's schedulers, ``running``): starts from ``first_gen_tokens`` (the ctx's
   sampled token is forced, so outputs equal an aggregated run's, seeded sampling included).
4. **Stream out**: every output token (``first_gen_tokens`` included) goes back as SSE or one
   answer; a client that leaves (the router cancels with ``POST /v1/abort``) aborts it on every
   rank: a transfer in flight is cancelled (the ctx stops sending) and its blocks are freed once
   nothing can write into them.

The worker drives the SPMD helix world (:mod:`.world`) when dp x cp > 1 or ``kv_source`` is
``ucx``: rank 0 is this process, the other ranks its children (or srun / torchrun tasks). A dead
rank or a stopped world makes ``/health`` answer 503 naming it, and requests fail fast with it.
Requests without ``disaggregated_params`` run aggregated here (prefill and decode): the baseline
that disaggregated answers must equal.

Once rank 0 assigned it a CP group, a request's state (awaiting cache -> receiving -> decoding ->
finished) lives in one table, :class:`~helixserve.engine.spmd.lifecycle.GenRequestLife`,
moved on the engine thread. A ``generation_only`` whose id is alive here is refused (400
``duplicate_request_id``) and touches nothing of the live one.
"""
