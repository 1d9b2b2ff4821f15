"""GPU fast paths (fla KDA, our Triton kernels, grouped-GEMM MoE) == the PyTorch reference on CPU.

Each test builds inputs on the CPU, runs the public ``helixserve.kernels`` function on CPU copies
(reference) and on CUDA copies (fast path), and compares: odd shapes, varlen batches with sequences
shorter than a chunk, scattered state slots, paged caches with shuffled blocks, ``-1`` (helix) table
entries and NaN sentinels in unused cache memory. fp32 runs compare tightly; bf16 loosely.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # fp32 dots in fla exact, like the reference

from helixserve import kernels  # noqa: E402
from tests._testing import assert_close  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def both(*tensors: torch.Tensor):
    """(cpu tensors, cuda copies)."""
    return tensors, tuple(t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in tensors)


def kda_inputs(T: int, H: int, K: int, V: int, seed: int, dtype=torch.float32):
    g_ = gen(seed)
    q, k = torch.randn(T, H, K, generator=g_).to(dtype), torch.randn(T, H, K, generator=g_).to(dtype)
    v = torch.randn(T, H, V, generator=g_).to(dtype)
    g = -torch.rand(T, H, K, generator=g_) * 0.6 - 0.01
    beta = torch.rand(T, H, generator=g_)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("K,V", [(128, 128)])
def test_kda_chunk_prefill_varlen(dtype, tol, K, V):
    seq_lens = [1, 63, 64, 65, 200, 7]
    H = 3
    T = sum(seq_lens)
    q, k, v, g, beta = kda_inputs(T, H, K, V, seed=0, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    h0 = torch.randn(len(seq_lens), H, K, V, generator=gen(1)) * 0.1
    cpu, gpu = both(q, k, v, g, beta, h0, cu)
    o_ref, s_ref = kernels.kda_chunk_prefill(*cpu[:5], initial_state=cpu[5], cu_seqlens=cpu[6], use_qk_l2norm=True)
    o, s = kernels.kda_chunk_prefill(*gpu[:5], initial_state=gpu[5], cu_seqlens=gpu[6], use_qk_l2norm=True)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close("o", o_ref.float(), o.float(), tol)
    assert_close("state", s_ref, s, tol)


@pytest.mark.parametrize("K,V", [(128, 128), (100, 60)])
def test_kda_recurrent_step_at_scattered_slots(K, V):
    B, H, S = 37, 4, 50
    q, k, v, g, beta = kda_inputs(B, H, K, V, seed=2)
    slots = torch.randperm(S, generator=gen(3))[:B]
    pool = torch.randn(S, H, K, V, generator=gen(4)) * 0.1
    cpu, gpu = both(q, k, v, g, beta, pool, slots)
    o_ref = kernels.kda_recurrent_step(*cpu, use_qk_l2norm=True)
    o = kernels.kda_recurrent_step(*gpu, use_qk_l2norm=True)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("pool", cpu[5], gpu[5], 1e-5)  # updated slots, and the others untouched


def test_short_conv_prefill_and_step():
    D, W, S = 3 * 3 * 33, 4, 20
    weight = torch.randn(D, W, generator=gen(5))
    seq_lens = [5, 1, 2, 0, 40]
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), D, generator=gen(6))
    state = torch.randn(len(seq_lens), D, W - 1, generator=gen(7))
    for dtype in (torch.float32, torch.bfloat16):
        cpu, gpu = both(x.to(dtype), weight.to(dtype), state.to(dtype), cu)
        y_ref, s_ref = kernels.short_conv_prefill(cpu[0], cpu[1], conv_state=cpu[2], cu_seqlens=cpu[3])
        y, s = kernels.short_conv_prefill(gpu[0], gpu[1], conv_state=gpu[2], cu_seqlens=gpu[3])
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert_close("prefill y", y_ref.float(), y.float(), tol)
        assert_close("prefill state", s_ref.float(), s.float(), tol)
    pool = torch.randn(S, D, W - 1, generator=gen(8))
    slots = torch.randperm(S, generator=gen(9))[:11]
    cpu, gpu = both(torch.randn(11, D, generator=gen(10)), weight, pool, slots)
    y_ref = kernels.short_conv_step(*cpu)
    y = kernels.short_conv_step(*gpu)
    assert_close("step y", y_ref, y, 1e-6)
    assert torch.equal(cpu[2], gpu[2].cpu())


def paged_cache(seq_lens, D, BS, dtype, seed):
    g_ = gen(seed)
    max_blocks = max(-(-L // BS) for L in seq_lens) + 2
    num_blocks = sum(-(-L // BS) for L in seq_lens) + 5
    free = torch.randperm(num_blocks, generator=g_).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for i, L in enumerate(seq_lens):
        for b in range(-(-L // BS)):
            tables[i, b] = free.pop()
    cache = torch.full((num_blocks, BS, D), float("nan"), dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(L) for L in seq_lens])
    latent = torch.randn(int(cu[-1]), D, generator=g_).to(dtype)
    return cache, tables, cu, positions, latent


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("BS", [16, 64])
def test_mla_write_and_paged_attention(dtype, tol, BS):
    H, D, V_DIM, scale = 16, 576, 512, 192**-0.5
    seq_lens = [1, 37, 130, 600, 64, 5]
    cache, tables, cu, positions, latent = paged_cache(seq_lens, D, BS, dtype, seed=11)
    cpu, gpu = both(cache, tables, cu, positions, latent)
    kernels.mla_write_kv(*cpu)
    kernels.mla_write_kv(*gpu)
    assert torch.equal(cpu[0].float().nan_to_num(7.0), gpu[0].cpu().float().nan_to_num(7.0))
    B = len(seq_lens)
    for helix in (False, True):
        local = tables.clone()
        if helix:  # odd logical blocks held on another rank
            local[:, 1::2] = -1
        # decode: the last position of each sequence (one a shorter kv_len, one with none)
        q = torch.randn(B, H, D, generator=gen(12)).to(dtype)
        q_pos = torch.tensor(seq_lens) - 1
        kv_lens = torch.tensor(seq_lens)
        kv_lens[1] = 20
        kv_lens[4] = 0
        args = (q, cpu[0], local, torch.arange(B + 1), q_pos, kv_lens)
        o_ref, lse_ref = kernels.mla_paged_attention(*args, scale=scale, v_dim=V_DIM)
        o, lse = kernels.mla_paged_attention(*(a.to(CUDA) for a in args[:1]), gpu[0],
                                             *(a.to(CUDA) for a in args[2:]), scale=scale, v_dim=V_DIM)
        assert_close(f"decode o helix={helix}", o_ref.float(), o.float(), tol)
        assert_close(f"decode lse helix={helix}", lse_ref, lse, tol)
        if dtype == torch.bfloat16:  # the tuned launch shapes: value columns split, other tiles
            from helixserve.kernels.mla import triton_mla

            for kw in (dict(dv_parts=2, num_splits=3), dict(dv_parts=4, block_n=64, num_stages=3)):
                o, lse = triton_mla.paged_attention(*(a.to(CUDA) for a in args[:1]), gpu[0],
                                                    *(a.to(CUDA) for a in args[2:]), scale, V_DIM, **kw)
                assert_close(f"decode o helix={helix} {kw}", o_ref.float(), o.float(), tol)
                assert_close(f"decode lse helix={helix} {kw}", lse_ref, lse, tol)
    # prefill chunk with context: the last 50 (or fewer) rows of each sequence
    q_rows = torch.cat([torch.arange(max(0, L - 50), L) for L in seq_lens])
    cu_q = torch.tensor([0, *torch.tensor([min(50, L) for L in seq_lens]).cumsum(0).tolist()])
    q = torch.randn(q_rows.numel(), H, D, generator=gen(13)).to(dtype)
    args = (q, cpu[0], tables, cu_q, q_rows, torch.tensor(seq_lens))
    o_ref, lse_ref = kernels.mla_paged_attention(*args, scale=scale, v_dim=V_DIM)
    o, lse = kernels.mla_paged_attention(q.to(CUDA), gpu[0], *(a.to(CUDA) for a in args[2:]), scale=scale,
                                         v_dim=V_DIM)
    assert_close("prefill o", o_ref.float(), o.float(), tol)
    assert_close("prefill lse", lse_ref, lse, tol)


def test_lse_combine():
    o_parts, lse_parts = torch.randn(4, 33, 7, 512, generator=gen(14)), torch.randn(4, 33, 7, generator=gen(15))
    lse_parts[:, 0] = float("-inf")
    lse_parts[2, 3] = float("-inf")
    o_parts[2, 3] = float("nan")
    cpu, gpu = both(o_parts, lse_parts)
    o_ref, lse_ref = kernels.lse_combine(*cpu)
    o, lse = kernels.lse_combine(*gpu)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("lse", lse_ref, lse, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix(dtype):
    M, D, K = 19, 7168, 7
    prefix, bank = torch.randn(M, D, generator=gen(16)).to(dtype), torch.randn(K, M, D, generator=gen(17)).to(dtype)
    norm_w, proj_w = (torch.rand(D, generator=gen(18)) + 0.5).to(dtype), torch.randn(1, D, generator=gen(19)).to(dtype)
    cpu, gpu = both(prefix, bank, norm_w, proj_w)
    ref = kernels.attn_res_mix(*cpu, 1e-5)
    out = kernels.attn_res_mix(*gpu, 1e-5)
    assert_close("mix", ref.float(), out.float(), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("E,top_k", [(896, 16), (37, 5)])
def test_moe_route(E, top_k):
    logits, bias = torch.randn(45, E, generator=gen(20)), torch.randn(E, generator=gen(21)) * 0.05
    cpu, gpu = both(logits, bias)
    w_ref, ids_ref = kernels.moe_route(cpu[0], top_k=top_k, correction_bias=cpu[1], renormalize=True,
                                       routed_scaling_factor=2.446)
    w, ids = kernels.moe_route(gpu[0], top_k=top_k, correction_bias=gpu[1], renormalize=True,
                               routed_scaling_factor=2.446)
    assert torch.equal(ids_ref, ids.cpu())
    assert_close("weights", w_ref, w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("expert_offset", [0, 8])
def test_moe_experts(dtype, expert_offset):
    T, D, I, E_local, top_k = 37, 256, 96, 16, 4
    x = torch.randn(T, D, generator=gen(22)).to(dtype)
    w13 = (torch.randn(E_local, 2 * I, D, generator=gen(23)) / 16).to(dtype)
    w2 = (torch.randn(E_local, D, I, generator=gen(24)) / 10).to(dtype)
    weights, ids = kernels.moe_route(torch.randn(T, 32, generator=gen(25)), top_k=top_k, correction_bias=None,
                                     renormalize=True, routed_scaling_factor=1.0)
    cpu, gpu = both(x, ids, weights, w13, w2)
    ref = kernels.moe_experts(*cpu, expert_offset=expert_offset, activation="situ")
    out = kernels.moe_experts(*gpu, expert_offset=expert_offset, activation="situ")
    assert_close("experts", ref.float(), out.float(), 1e-5 if dtype == torch.float32 else 1.5e-2)


def test_grouped_mm_available_for_bf16():
    from helixserve.kernels.moe import gpu as moe_gpu

    x = torch.zeros(8, 64, dtype=torch.bfloat16, device=CUDA)
    w = torch.zeros(4, 128, 64, dtype=torch.bfloat16, device=CUDA)
    assert moe_gpu.can_group(x, w, w)


@pytest.mark.parametrize("align", [16, 8, 2])
def test_unit_copy_at_pull_shapes(align):
    """The pull's unit copy on the GPU (16-byte vectors when every offset allows them, narrower
    words otherwise): a fragmented 48B-like shard (MLA blocks of 72 KiB over 7 layers, a 2 MiB
    state and three conv slices over 20 layers) lands byte-exact, and nothing else is written."""
    import numpy as np

    from helixserve.kernels.copy import triton_units
    from helixserve.kernels.copy.units import UnitGroup, unit_copy, unit_copy_reference

    gen = torch.Generator().manual_seed(align)
    block, blocks = 73728, 48
    srcs = [torch.randint(0, 256, (blocks * block + 64,), dtype=torch.uint8, generator=gen) for _ in range(7)]
    srcs += [torch.randint(0, 256, ((2 << 20) * 2 + 64,), dtype=torch.uint8, generator=gen) for _ in range(20)]
    dsts = [torch.zeros_like(t) for t in srcs]
    perm = torch.randperm(blocks, generator=gen)[:40].numpy()
    shift = 0 if align == 16 else align  # offsets that are multiples of `align` only
    mla = UnitGroup(block, np.stack([np.arange(7), np.arange(7)], 1),
                    np.stack([perm * block + shift, np.arange(40) * block], 1))
    state = UnitGroup(2 << 20, np.stack([np.arange(7, 27)] * 2, 1), np.asarray([[(2 << 20) + shift, 0]]))
    conv = UnitGroup(3 * 1024, np.stack([np.arange(7, 27)] * 2, 1),
                     np.asarray([[s * 8192 + shift, (2 << 20) + s * 4096] for s in range(3)]))
    groups = [state, conv, mla]
    want = [d.clone() for d in dsts]
    unit_copy_reference(srcs, want, groups)
    cuda_srcs, cuda_dsts = [t.cuda() for t in srcs], [t.cuda() for t in dsts]
    _, _, word, vec = triton_units.pack(cuda_srcs, cuda_dsts, groups)
    assert word * vec == align
    unit_copy(cuda_srcs, cuda_dsts, groups)
    torch.cuda.synchronize()
    for w, d in zip(want, cuda_dsts):
        assert torch.equal(w, d.cpu())


@pytest.mark.parametrize("capacity_units", [8192, 2])
def test_unit_copier_graphs_replay_and_fall_back(monkeypatch, capacity_units):
    """A UnitCopier with graphs (as the pull uses it): copies replay captured graphs while a slot
    is free, and launch directly when every slot is busy (the stream held behind a GPU sleep) or
    a request's table does not fit a slot; requests that leave a group out, or need 8-byte words,
    land byte-exact either way, and nothing else is written."""
    import numpy as np

    from helixserve.kernels.copy import triton_units, unit_graphs
    from helixserve.kernels.copy.units import UnitCopier, UnitGroup, unit_copy_reference

    monkeypatch.setattr(unit_graphs, "CAPACITY_UNITS", capacity_units)
    gen = torch.Generator().manual_seed(capacity_units)
    block, blocks = 73728, 48
    srcs = [torch.randint(0, 256, (blocks * block,), dtype=torch.uint8, generator=gen) for _ in range(3)]
    srcs += [torch.randint(0, 256, (4 * 65536,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    dsts = [torch.zeros_like(t) for t in srcs]
    mla_seg, head_seg = np.stack([np.arange(3)] * 2, 1), np.stack([np.arange(3, 5)] * 2, 1)
    requests = []
    for r in range(9):
        src_blocks = torch.randperm(blocks, generator=gen)[:4].numpy()
        units = np.stack([src_blocks * block, (np.arange(4) + 4 * r) * block], 1)
        request = [UnitGroup(block, mla_seg, units)]
        if r % 3 == 0:  # the others leave the head group out
            request.append(UnitGroup(8192, head_seg, np.asarray([[65536 * (r % 4), 8192 * r + (8 if r == 6 else 0)]])))
        requests.append(request)
    want = [d.clone() for d in dsts]
    for request in requests:
        unit_copy_reference(srcs, want, request)
    cuda_srcs, cuda_dsts = [t.cuda() for t in srcs], [t.cuda() for t in dsts]
    warm = UnitCopier(cuda_srcs, [d.clone() for d in cuda_dsts], [mla_seg, head_seg])  # compiles every
    for request in requests:  # direct launch's variant first: a compile behind the GPU sleep would outlast it
        warm.copy(request)
    copier = UnitCopier(cuda_srcs, cuda_dsts, [mla_seg, head_seg], graphs=True)
    copier.copy(requests[0])  # builds the table and captures the graphs
    torch.cuda.synchronize()  # (its slot is free again)
    graphs = copier._table.graphs
    assert graphs is not None and len(graphs._slots) == unit_graphs.SLOTS
    launches = []
    real_launch = triton_units._launch
    monkeypatch.setattr(triton_units, "_launch", lambda *a, **k: (launches.append(a[2]), real_launch(*a, **k)))
    torch.cuda._sleep(200_000_000)  # ~0.1 s: no slot frees while the rest are issued
    for request in requests[1:]:
        copier.copy(request)
    torch.cuda.synchronize()
    for w, d in zip(want, cuda_dsts):
        assert torch.equal(w, d.cpu())
    if capacity_units == 2:  # no table fits: every copy launched directly
        assert len(launches) == len(requests) - 1 and not any(s.used for s in graphs._slots)
    else:  # the first SLOTS replayed, then every slot was busy (r = 6 also needs 8-byte words)
        assert all(s.used for s in graphs._slots)
        assert len(launches) == len(requests) - 1 - unit_graphs.SLOTS


def test_warm_up_copy_checks_direct_and_graph_copies():
    """The gen's warm-up of the pull: direct launches for one to three groups and a captured
    graph replay (a process's first capture and pinned tables, before any request); it raises
    if either copy is wrong."""
    from helixserve.transceiver.gen.pull import warm_up_copy

    warm_up_copy(torch.device("cuda", torch.cuda.current_device()))


def test_unit_copier_graphs_take_only_one_group_per_segments_array():
    """Two groups over one segments array (what a graph's table cannot place) are both copied:
    such a copy launches directly instead of replaying a graph."""
    import numpy as np

    from helixserve.kernels.copy.units import UnitCopier, UnitGroup

    src = torch.arange(1024, dtype=torch.int64, device="cuda").view(torch.uint8)
    dst = torch.zeros_like(src)
    seg = np.zeros((1, 2), dtype=np.int64)
    copier = UnitCopier([src], [dst], [seg], graphs=True)
    copier.copy([UnitGroup(16, seg, np.asarray([[0, 0]])), UnitGroup(32, seg, np.asarray([[64, 64]]))])
    torch.cuda.synchronize()
    assert torch.equal(dst[:16], src[:16]) and torch.equal(dst[64:96], src[64:96])
    assert not dst[16:64].any() and not dst[96:].any()
