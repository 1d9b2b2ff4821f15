"""GPU transfers between two processes: a ctx (KVSender) and this test's gen rank (KVReceiver),
pools on the GPU on both sides. The shard arrives byte-exact, pulled over CUDA IPC and over the
tagged UCX stream (device staging), for whole shards (cp 1) and a cp 2 rank's blocks and KDA
head slices, from fragmented blocks on both sides; a cancel mid-transfer frees both sides; a
killed ctx fails the transfer within its deadline. GPU-marked: runs on an H200 (skipped without
CUDA); the CPU suite covers the same code's tagged path on host memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("ucxx")

PRESET = "kimi-k3-tiny"
TPB = 16
NUM_TOKENS = 5 * TPB + 3  # crosses pages; the last block is partial
TIMEOUT_MS = 8000.0


def _caches(fill: bool, cp_size: int = 1):
    import dataclasses

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset

    spec = cache_spec_for(get_preset(PRESET), torch.bfloat16, TPB)
    spec = dataclasses.replace(spec, kda_num_heads=spec.kda_num_heads // cp_size)  # a CP rank's heads
    caches = allocate_model_caches(spec, 32, 4, device="cuda")
    if fill:  # a distinct byte pattern per layer and kind
        for k, pools in enumerate((caches.mla_kv, caches.kda_state, caches.conv_state)):
            for layer_id, pool in pools.items():
                flat = pool.view(-1).view(torch.uint8)
                flat.copy_(((torch.arange(flat.numel(), device="cuda") * (layer_id + 3) + 17 * k) % 251).to(torch.uint8))
    return caches


def _layout():
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    return layout_for(get_preset(PRESET), torch.bfloat16, TPB, PRESET)


def _config(cuda_ipc: bool = True):
    from helixserve.config_transceiver import TransceiverConfig

    return TransceiverConfig(kv_transfer_timeout_ms=TIMEOUT_MS, cuda_ipc=cuda_ipc, message_bytes=64 << 10,
                             drain_timeout_ms=1000.0, rpc_timeout_ms=2000.0)


def _ctx_main(inbox, outbox) -> None:
    from helixserve.kvcache.manager import CacheManager
    from helixserve.transceiver.ctx.sender import KVSender

    caches = _caches(fill=True)
    torch.cuda.synchronize()
    freed = mp.SimpleQueue()
    sender = KVSender(_config(), _layout(), caches, freed.put)
    manager = CacheManager(32, 4, TPB)
    manager.allocate("pad-a", 2 * TPB), manager.allocate("pad-b", 3 * TPB)
    manager.free("pad-a")  # the held request's blocks are not one run
    outbox.put(sender.start().model_dump())
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "hold":
            handle = manager.allocate(cmd[1], NUM_TOKENS)
            grant = sender.hold(cmd[1], handle, NUM_TOKENS, [7])
            outbox.put((list(handle.block_ids), handle.slot, grant.model_dump() if grant else None))
        elif cmd[0] == "cancel":
            outbox.put(sender.cancel(cmd[1], "cancelled by the test"))
        elif cmd[0] == "stats":
            while not freed.empty():
                manager.free(freed.get())
            stats = sender.stats()
            outbox.put((stats.num_held, stats.num_freed))
    sender.stop()


@pytest.fixture()
def ctx_worker():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ctx_main, args=(inbox, outbox))
    proc.start()
    endpoint = outbox.get(timeout=120)
    yield proc, inbox, outbox, endpoint
    if proc.is_alive():
        inbox.put(("stop",))
        proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


def _receiver(cuda_ipc: bool, cp_rank: int, cp_size: int, endpoint):
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.control import target
    from helixserve.transceiver.gen.receiver import KVReceiver

    rx = KVReceiver(_config(cuda_ipc), _layout(), cp_rank=cp_rank, cp_size=cp_size)
    if cuda_ipc:  # open the ctx's pools before the transfer (the first request would go tagged)
        ep = TransceiverEndpoint.model_validate(endpoint)
        rx.prefetch([ep], torch.device("cuda", 0))  # as a gen rank does at start
        end, pools = time.monotonic() + 30, None
        while pools is None and time.monotonic() < end:
            pools = rx.pools.get(target(ep), rx.clients.get(ep), torch.device("cuda", 0))
            time.sleep(0.01)
        assert pools is not None, "the ctx's pools did not open over CUDA IPC"
    return rx


def _params(rid: str, endpoint, grant: dict | None = None):
    from helixserve.protocol.disagg import DisaggregatedParams

    return DisaggregatedParams(request_type="generation_only", ctx_request_id=rid, first_gen_tokens=[7],
                               prompt_token_ids=[1] * NUM_TOKENS, ctx_endpoint=endpoint, layout=_layout(),
                               pull_grant=grant)


def _ctx_held_after(inbox, outbox, limit_s: float = 10.0) -> int:
    """The ctx's holds once they dropped to 0, or its count after `limit_s`."""
    end = time.monotonic() + limit_s
    while True:
        inbox.put(("stats",))
        held, _ = outbox.get(timeout=limit_s)
        if held == 0 or time.monotonic() >= end:
            return held
        time.sleep(0.05)


def _wait(rx, rid: str, limit_s: float = 20.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        done = rx.poll(wait_num=1, interval_s=0.01)
        if rid in done:
            return done[rid], time.monotonic()
    pytest.fail(f"transfer {rid} did not end within {limit_s} s")


@pytest.mark.parametrize("mode", ["granted", "pulled", "tagged"])
@pytest.mark.parametrize("cp_rank,cp_size", [(0, 1), (1, 2)])
def test_cuda_shard_arrives_byte_exact(ctx_worker, mode, cp_rank, cp_size):
    from helixserve.kvcache.helix import local_logical_blocks
    from helixserve.kvcache.manager import CacheManager

    _, inbox, outbox, endpoint = ctx_worker
    cuda_ipc = mode != "tagged"
    rx = _receiver(cuda_ipc, cp_rank, cp_size, endpoint)
    caches = _caches(fill=False, cp_size=cp_size)
    manager = CacheManager(32, 4, TPB, cp_rank=cp_rank, cp_size=cp_size)
    manager.allocate("gen-pad", 3 * TPB * cp_size)  # the destination blocks do not start at 0 either
    inbox.put(("hold", "r1"))
    ctx_blocks, ctx_slot, grant = outbox.get(timeout=30)
    assert grant is not None, "a ctx with its pools on the GPU grants a pull"
    handle = manager.allocate("r1", NUM_TOKENS)
    rx.start("r1", handle, caches, _params("r1", endpoint, grant if mode == "granted" else None))
    if mode == "granted":  # launched at start: no RequestShard in flight
        transport = rx.inbounds["r1"].transport
        assert transport.name == "granted pull" and transport.copy is not None and not transport.has_asked
    error, _ = _wait(rx, "r1")
    assert error is None
    assert (rx.num_granted, rx.num_pulled) == {"granted": (1, 0), "pulled": (0, 1), "tagged": (0, 0)}[mode]
    expected = _caches(fill=True)  # the ctx's pools, recomputed here
    shard_blocks = local_logical_blocks(NUM_TOKENS, TPB, cp_rank, cp_size)
    heads = _layout().num_kda_heads // cp_size
    h0 = cp_rank * heads
    for layer_id, pool in caches.mla_kv.items():
        for k, logical in enumerate(shard_blocks):
            got, want = pool[handle.block_ids[k]], expected.mla_kv[layer_id][ctx_blocks[logical]]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer_id, logical)
    for layer_id, pool in caches.kda_state.items():
        want = expected.kda_state[layer_id][ctx_slot, h0 : h0 + heads]
        assert torch.equal(pool[handle.slot].view(torch.uint8), want.contiguous().view(torch.uint8)), layer_id
    k_dim = _layout().kda_head_dim
    for layer_id, pool in caches.conv_state.items():
        full = expected.conv_state[layer_id][ctx_slot]
        h_all = _layout().num_kda_heads
        want = torch.cat([full[s * h_all * k_dim + h0 * k_dim : s * h_all * k_dim + (h0 + heads) * k_dim]
                          for s in range(3)])
        assert torch.equal(pool[handle.slot].view(torch.uint8), want.view(torch.uint8)), layer_id
    assert _ctx_held_after(inbox, outbox) == 0, "the ctx still holds the acknowledged request"
    rx.close()


@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["pulled", "tagged"])
def test_cuda_cancel_mid_transfer_frees_both_sides(ctx_worker, cuda_ipc):
    from helixserve.kvcache.manager import CacheManager

    _, inbox, outbox, endpoint = ctx_worker
    rx = _receiver(cuda_ipc, 0, 1, endpoint)
    caches = _caches(fill=False)
    manager = CacheManager(32, 4, TPB)
    inbox.put(("hold", "r2"))
    grant = outbox.get(timeout=30)[2]
    rx.start("r2", manager.allocate("r2", NUM_TOKENS), caches, _params("r2", endpoint, grant if cuda_ipc else None))
    rx.progress()
    assert rx.cancel("r2", "client gone")  # returns once nothing can write into the handle
    manager.free("r2")
    assert "r2" not in rx.inbounds
    assert _ctx_held_after(inbox, outbox) == 0, "the ctx still holds the cancelled request"
    rx.close()


def test_cuda_killed_ctx_fails_the_transfer_within_its_deadline(ctx_worker):
    from helixserve.kvcache.manager import CacheManager

    proc, inbox, outbox, endpoint = ctx_worker
    rx = _receiver(True, 0, 1, endpoint)
    inbox.put(("hold", "r3"))
    outbox.get(timeout=30)
    os.kill(proc.pid, 9)
    proc.join(timeout=10)
    manager = CacheManager(32, 4, TPB)
    start = time.monotonic()
    rx.start("r3", manager.allocate("r3", NUM_TOKENS), _caches(fill=False), _params("r3", endpoint))
    error, ended = _wait(rx, "r3", limit_s=TIMEOUT_MS / 1e3 + 5)
    assert error is not None and "r3" in error
    assert ended - start <= TIMEOUT_MS / 1e3 + 1.0
    rx.cancel("r3")
    rx.close()


def test_cuda_grant_of_a_freed_request_is_never_read(ctx_worker):
    """The ctx cancelled (and so freed) the hold before the gen used its grant: its lease word
    is zeroed, so the gen rank never copies and asks instead, which the ctx refuses."""
    from helixserve.kvcache.manager import CacheManager

    _, inbox, outbox, endpoint = ctx_worker
    rx = _receiver(True, 0, 1, endpoint)
    manager = CacheManager(32, 4, TPB)
    inbox.put(("hold", "r3"))
    grant = outbox.get(timeout=30)[2]
    inbox.put(("cancel", "r3"))
    assert outbox.get(timeout=30) is True
    assert _ctx_held_after(inbox, outbox) == 0
    rx.start("r3", manager.allocate("r3", NUM_TOKENS), _caches(fill=False), _params("r3", endpoint, grant))
    inbound = rx.inbounds["r3"]
    assert inbound.transport.name == "asked pull" and inbound.transport.copy is None and not inbound.retired, \
        "a revoked grant was copied"
    error, _ = _wait(rx, "r3")
    assert error is not None and "not held here" in error
    assert (rx.num_granted, rx.num_pulled) == (0, 0)
    rx.close()


def test_cuda_grant_for_another_request_is_refused(ctx_worker):
    """A grant names its request (MAC over id, prompt length, first tokens, blocks): presented
    for another request, or with its blocks changed, it is not used; the rank asks instead."""
    from helixserve.kvcache.manager import CacheManager

    _, inbox, outbox, endpoint = ctx_worker
    rx = _receiver(True, 0, 1, endpoint)
    manager = CacheManager(32, 4, TPB)
    inbox.put(("hold", "r4"))
    grant = outbox.get(timeout=30)[2]
    inbox.put(("hold", "r5"))
    outbox.get(timeout=30)
    forged = {**grant, "block_ids": list(reversed(grant["block_ids"]))}
    rx.start("r5", manager.allocate("r5", NUM_TOKENS), _caches(fill=False), _params("r5", endpoint, grant))
    rx.start("r4", manager.allocate("r4", NUM_TOKENS), _caches(fill=False), _params("r4", endpoint, forged))
    assert [rx.inbounds[r].transport.name for r in ("r5", "r4")] == ["asked pull", "asked pull"]  # no grant used
    outcomes: dict = {}
    end = time.monotonic() + 20
    while len(outcomes) < 2 and time.monotonic() < end:  # each outcome is reported once
        outcomes.update(rx.poll(wait_num=1, interval_s=0.01))
    assert outcomes == {"r4": None, "r5": None}  # asked with RequestShard, pulled on the ctx's own answer
    assert (rx.num_granted, rx.num_pulled) == (0, 2)
    assert _ctx_held_after(inbox, outbox) == 0
    rx.close()
