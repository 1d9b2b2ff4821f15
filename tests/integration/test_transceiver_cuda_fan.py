"""GPU pulls from a ctx world: the two ranks of a ctx world of tp 2 (each its own process, its
KVSender over pools of H/2 heads and its own blocks, on the one GPU) and this test's gen rank
(cp 1: it pulls from both ranks; cp 2 rank 1: its blocks from both, its heads from rank 1). Each
gen rank opens every rank's pools over CUDA IPC and copies the part each holds: byte-exact
against the ranks' pools, and both ranks free the request once acknowledged. GPU-marked (skipped
without CUDA); the CPU suite holds the same unit groups to the single-process cache
(tests/unit/test_transceiver_pull.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("ucxx")

PRESET = "kimi-k3-tiny"
TPB = 16
TP = 2
NUM_TOKENS = 5 * TPB + 3  # 6 blocks: 3 on each ctx rank, the last partial
TIMEOUT_MS = 8000.0


def _layout(ctx_rank: int | None = None):
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    layout = layout_for(get_preset(PRESET), torch.bfloat16, TPB, PRESET)
    if ctx_rank is None:
        return layout
    return layout.model_copy(update={"ctx_tp_size": TP, "ctx_rank": ctx_rank})


def _caches(heads_div: int, pattern: int | None):
    import dataclasses

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset

    spec = cache_spec_for(get_preset(PRESET), torch.bfloat16, TPB)
    spec = dataclasses.replace(spec, kda_num_heads=spec.kda_num_heads // heads_div)
    caches = allocate_model_caches(spec, 32, 4, device="cuda")
    if pattern is not None:  # a distinct byte pattern per ctx rank, layer and kind
        for k, pools in enumerate((caches.mla_kv, caches.kda_state, caches.conv_state)):
            for layer_id, pool in pools.items():
                flat = pool.view(-1).view(torch.uint8)
                idx = torch.arange(flat.numel(), device="cuda")
                flat.copy_(((idx * (layer_id + 3) + 17 * k + 101 * pattern) % 251).to(torch.uint8))
    return caches


def _config(cuda_ipc: bool = True):
    from helixserve.config_transceiver import TransceiverConfig

    return TransceiverConfig(kv_transfer_timeout_ms=TIMEOUT_MS, cuda_ipc=cuda_ipc, message_bytes=64 << 10,
                             drain_timeout_ms=1000.0, rpc_timeout_ms=2000.0)


def _ctx_rank_main(rank: int, inbox, outbox) -> None:
    from helixserve.kvcache.manager import CacheManager
    from helixserve.transceiver.ctx.sender import KVSender

    caches = _caches(TP, rank)
    torch.cuda.synchronize()
    freed = mp.SimpleQueue()
    sender = KVSender(_config(), _layout(rank), caches, freed.put)
    manager = CacheManager(32, 4, TPB, cp_rank=rank, cp_size=TP)
    manager.allocate("pad-a", 2 * TPB * TP), manager.allocate("pad-b", 3 * TPB * TP)
    manager.free("pad-a")  # the held request's blocks are not one run
    outbox.put(sender.start().model_dump())
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "hold":
            handle = manager.allocate(cmd[1], NUM_TOKENS)
            grant = sender.hold(cmd[1], handle, NUM_TOKENS, [7])
            outbox.put((list(handle.block_ids), handle.slot, grant is not None))
        elif cmd[0] == "stats":
            while not freed.empty():
                manager.free(freed.get())
            outbox.put(sender.stats().num_held)
    sender.stop()


@pytest.fixture(scope="module")
def ctx_world():
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in range(TP):
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_ctx_rank_main, args=(rank, inbox, outbox))
        proc.start()
        ranks.append((proc, inbox, outbox))
    endpoints = [outbox.get(timeout=120) for _, _, outbox in ranks]
    yield ranks, endpoints
    for proc, inbox, _ in ranks:
        if proc.is_alive():
            inbox.put(("stop",))
            proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _receiver(cp_rank: int, cp_size: int, endpoints):
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.control import target
    from helixserve.transceiver.gen.receiver import KVReceiver

    rx = KVReceiver(_config(), _layout(), cp_rank=cp_rank, cp_size=cp_size)
    eps = [TransceiverEndpoint.model_validate(e) for e in endpoints]
    device = torch.device("cuda", 0)
    rx.prefetch(eps, device)
    end = time.monotonic() + 30
    while time.monotonic() < end and not all(rx.pools.get(target(ep), rx.clients.get(ep), device) for ep in eps):
        time.sleep(0.01)
    assert all(rx.pools.get(target(ep), rx.clients.get(ep), device) for ep in eps), "a ctx rank's pools did not open"
    return rx


def _wait(rx, rid: str, limit_s: float = 20.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        done = rx.poll(wait_num=1, interval_s=0.01)
        if rid in done:
            return done[rid]
    pytest.fail(f"transfer {rid} did not end within {limit_s} s")


def _check_rank(caches, handle, held, cp_rank: int, cp_size: int) -> None:
    """This gen rank's pools against its shard of the ctx ranks' pools (recomputed here)."""
    from helixserve.kvcache.helix import local_logical_blocks

    heads = _layout().num_kda_heads
    per_rank, k_dim = heads // TP, _layout().kda_head_dim
    expected = [_caches(TP, s) for s in range(TP)]
    for k, b in enumerate(local_logical_blocks(NUM_TOKENS, TPB, cp_rank, cp_size)):
        s = b % TP
        for layer_id, pool in caches.mla_kv.items():
            want = expected[s].mla_kv[layer_id][held[s][0][b // TP]]
            assert torch.equal(pool[handle.block_ids[k]].view(torch.uint8), want.view(torch.uint8)), (layer_id, b)
    mine = heads // cp_size
    for i, h in enumerate(range(cp_rank * mine, (cp_rank + 1) * mine)):
        s, local = h // per_rank, h % per_rank
        for layer_id, pool in caches.kda_state.items():
            want = expected[s].kda_state[layer_id][held[s][1], local]
            assert torch.equal(pool[handle.slot, i].view(torch.uint8), want.contiguous().view(torch.uint8)), (layer_id, h)
        for layer_id, pool in caches.conv_state.items():
            src = expected[s].conv_state[layer_id][held[s][1]]
            for sec in range(3):
                got = pool[handle.slot, (sec * mine + i) * k_dim: (sec * mine + i + 1) * k_dim]
                want = src[(sec * per_rank + local) * k_dim: (sec * per_rank + local + 1) * k_dim]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer_id, h, sec)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_each_gen_rank_pulls_its_shard_from_the_ctx_ranks_holding_it_byte_exact(ctx_world, cp_size):
    from helixserve.kvcache.manager import CacheManager
    from helixserve.protocol.disagg import DisaggregatedParams
    from helixserve.transceiver.fan import sources

    ranks, endpoints = ctx_world
    rid = f"w{cp_size}"
    held = []
    for _, inbox, outbox in ranks:
        inbox.put(("hold", rid))
        held.append(outbox.get(timeout=30))
    assert not any(granted for _, _, granted in held), "a ctx world's ranks grant no pull (each is asked)"
    params = DisaggregatedParams(request_type="generation_only", ctx_request_id=rid, first_gen_tokens=[7],
                                 prompt_token_ids=[1] * NUM_TOKENS, ctx_endpoint=endpoints[0],
                                 ctx_endpoints=endpoints, layout=_layout(0))
    gens = []
    for cp_rank in range(cp_size):
        rx = _receiver(cp_rank, cp_size, endpoints)
        caches = _caches(cp_size, None)
        manager = CacheManager(32, 4, TPB, cp_rank=cp_rank, cp_size=cp_size)
        manager.allocate("gen-pad", 3 * TPB * cp_size)  # the destination blocks do not start at 0 either
        handle = manager.allocate(rid, NUM_TOKENS)
        rx.start(rid, handle, caches, params)
        gens.append((rx, caches, handle))
    try:
        for cp_rank, (rx, caches, handle) in enumerate(gens):
            assert _wait(rx, rid) is None
            num_sources = len(sources(-(-NUM_TOKENS // TPB), _layout().num_kda_heads, TP, cp_rank, cp_size))
            assert rx.num_pulled == num_sources  # every part copied over CUDA IPC, none streamed
            _check_rank(caches, handle, held, cp_rank, cp_size)
        for _, inbox, outbox in ranks:  # every ctx rank frees on its gen ranks' acknowledgements
            end, left = time.monotonic() + 10, None
            while left != 0 and time.monotonic() < end:
                inbox.put(("stats",))
                left = outbox.get(timeout=10)
                time.sleep(0.05)
            assert left == 0, "a ctx rank still holds the acknowledged request"
    finally:
        for rx, _, _ in gens:
            rx.close()
