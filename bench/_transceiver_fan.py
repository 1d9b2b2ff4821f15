"""The transceiver bench's fan-in rows: one request to a gen CP group of 1, 2 or 4 ranks, from a ctx
worker of one rank (tp 1) and from a ctx world of 2 ranks (tp 2: each gen rank pulls its part from
the ctx rank holding it, :mod:`helixserve.transceiver.fan`), in the same run between the same two
processes (the ctx side: every sender; the gen side: every gen rank's receiver, each its own UCX
worker), every (tp, cp) pair in turn each round, paired per round. Seconds: every gen rank
started -> every one complete."""

from __future__ import annotations

import multiprocessing as mp
import time

TPB = 16
PRESET = "kimi-linear-48b"
GEN_CPS = (1, 2, 4)  # the gen CP groups
PAIRS = [(tp, cp) for cp in GEN_CPS for tp in (1, 2)]  # (ctx tp, gen cp)
TICK_S = 0.0002  # the gen side's poll tick (both rows alike)
MESSAGE_BYTES = 16 * 2**20


def _parts(max_tokens: int, tp: int, rank: int, reps: int):  # noqa: ANN202
    """(layout, caches, cache manager) of rank `rank` of `tp` (ctx) or of a gen CP group (``tp``: its cp)."""
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    cfg = get_preset(PRESET)
    num_blocks = -(-max_tokens // TPB) * 2
    caches = allocate_model_caches(cache_spec_for(cfg, torch.bfloat16, TPB, kda_num_heads=cfg.kda_num_heads // tp),
                                   num_blocks, 2)
    for pool in caches.tensors():
        pool.fill_(1.0)  # touch every page before timing
    layout = layout_for(cfg, torch.bfloat16, TPB, PRESET)
    return layout, caches, CacheManager(num_blocks, 2, TPB, rank, tp)


def fan_request_bytes(num_tokens: int) -> int:
    """The bytes one request moves: its MLA pages and one KDA state + conv state (all heads)."""
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.pools import bytes_per_block, bytes_per_slot
    from helixserve.models.presets import get_preset

    spec = cache_spec_for(get_preset(PRESET), torch.bfloat16, TPB)
    return -(-num_tokens // TPB) * bytes_per_block(spec) + bytes_per_slot(spec)


def _config():  # noqa: ANN202
    from helixserve.config_transceiver import TransceiverConfig

    return TransceiverConfig(kv_transfer_timeout_ms=60_000, message_bytes=MESSAGE_BYTES, send_window_bytes=64 * 2**20)


def _ctx_main(max_tokens: int, reps: int, inbox, outbox) -> None:  # noqa: ANN001
    """Senders: ``tp1`` (one, every head) and ``tp2`` (two, half the heads each)."""
    import torch

    from helixserve.transceiver.ctx.sender import KVSender

    torch.set_num_threads(1)
    freed: mp.SimpleQueue = mp.SimpleQueue()
    worlds = {}
    for tp in (1, 2):
        ranks = []
        for s in range(tp):
            layout, caches, manager = _parts(max_tokens, tp, s, reps)
            rank_layout = layout.model_copy(update={"ctx_tp_size": tp, "ctx_rank": s})
            sender = KVSender(_config(), rank_layout, caches, lambda rid, tp=tp, s=s: freed.put((tp, s, rid)))
            ranks.append((sender, manager, sender.start()))
        worlds[tp] = ranks
    outbox.put({tp: [endpoint.model_dump() for _, _, endpoint in ranks] for tp, ranks in worlds.items()})
    while (cmd := inbox.get())[0] != "stop":
        _, tp, rid, num_tokens = cmd
        for s, (sender, manager, _) in enumerate(worlds[tp]):
            while not manager.can_allocate(num_tokens):  # the previous hold is freed on its acks
                ftp, fs, frid = freed.get()
                worlds[ftp][fs][1].free(frid)
            sender.hold(rid, manager.allocate(rid, num_tokens), num_tokens, [1])
        outbox.put("held")
    for ranks in worlds.values():
        for sender, _, _ in ranks:
            sender.stop()


def _gen_main(max_tokens: int, reps: int, inbox, outbox) -> None:  # noqa: ANN001
    import torch

    from helixserve.transceiver.gen.receiver import KVReceiver

    torch.set_num_threads(1)
    groups = {}
    for cp in GEN_CPS:
        ranks = []
        for r in range(cp):
            layout, caches, manager = _parts(max_tokens, cp, r, reps)
            ranks.append((KVReceiver(_config(), layout, cp_rank=r, cp_size=cp, gen_rank=r), caches, manager))
        groups[cp] = ranks
    outbox.put("ready")
    while (cmd := inbox.get())[0] != "stop":
        _, cp, rid, ticket = cmd
        ranks = groups[cp]
        start = time.perf_counter()
        for receiver, caches, manager in ranks:
            handle = manager.allocate(rid, ticket.num_prompt_tokens)
            manager.arrange_for_sources(rid, ticket.layout.ctx_tp_size)  # as the gen's intake does
            receiver.start(rid, handle, caches, ticket)
        pending = set(range(cp))
        while pending:
            for r in list(pending):
                done = ranks[r][0].poll(wait_num=0)
                if rid in done:
                    assert done[rid] is None, done[rid]
                    pending.discard(r)
            time.sleep(TICK_S)
        elapsed = time.perf_counter() - start
        for _, _, manager in ranks:
            manager.free(rid)
        outbox.put(elapsed)
    for ranks in groups.values():
        for receiver, _, _ in ranks:
            receiver.close()


def bench_fan(num_tokens: int, reps: int) -> dict[tuple[int, int], list[float]]:
    """Seconds per request for each (ctx tp, gen cp) of :data:`PAIRS` (paired rounds, one warm-up
    round each)."""
    from helixserve.models.presets import get_preset
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.layout import layout_for
    from helixserve.transceiver.ticket import KVTicket
    import torch

    ctx = mp.get_context("spawn")
    (ctx_in, ctx_out), (gen_in, gen_out) = (ctx.Queue(), ctx.Queue()), (ctx.Queue(), ctx.Queue())
    procs = [ctx.Process(target=_ctx_main, args=(num_tokens, reps, ctx_in, ctx_out)),
             ctx.Process(target=_gen_main, args=(num_tokens, reps, gen_in, gen_out))]
    for proc in procs:
        proc.start()
    try:
        endpoints = {tp: [TransceiverEndpoint(**e) for e in es] for tp, es in ctx_out.get(timeout=120).items()}
        assert gen_out.get(timeout=120) == "ready"
        layout = layout_for(get_preset(PRESET), torch.bfloat16, TPB, PRESET)
        out: dict[tuple[int, int], list[float]] = {pair: [] for pair in PAIRS}
        for rep in range(reps + 1):
            for tp, cp in PAIRS:
                rid = f"fan{tp}-{cp}-{rep}"
                ctx_in.put(("hold", tp, rid, num_tokens))
                assert ctx_out.get(timeout=60) == "held"
                world = layout.model_copy(update={"ctx_tp_size": tp})
                ticket = KVTicket(rid, endpoints[tp][0], world, num_tokens, (1,),
                                  ctx_endpoints=tuple(endpoints[tp]) if tp > 1 else ())
                gen_in.put(("transfer", cp, rid, ticket))
                seconds = gen_out.get(timeout=120)
                if rep:  # the first round warms up
                    out[(tp, cp)].append(seconds)
        return out
    finally:
        for inbox in (ctx_in, gen_in):
            inbox.put(("stop",))
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
