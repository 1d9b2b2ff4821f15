"""The GPU fast paths on CPU: our Triton kernels (and fla's fused recurrent KDA) under Triton's
interpreter, and the sync-free MoE expert paths, each against the PyTorch reference.

Triton comes from the environment or from ``HELIXSERVE_TRITON_INTERP`` (a ``pip --target`` folder
that ``make test`` fills; only the child pytest sees it, since an importable Triton would send
transformers' and fla's KDA to GPU kernels in the CPU tests). Skipped when neither has Triton (it
is optional: the ``gpu`` extra). Small shapes keep the interpreter under a few seconds; the CUDA
runs of the same comparisons are in test_gpu_kernels.py.
"""

from __future__ import annotations


import pytest
import torch

from helixserve import kernels
from tests._testing import assert_close, needs_interpreter, run_under_triton_interpreter, triton_interpreter_patches



def test_kernels_under_triton_interpreter():
    """Triton decides at import whether kernels are interpreted, so the kernel tests of this file run
    in a child pytest with ``TRITON_INTERPRET=1`` set from the start."""
    run_under_triton_interpreter(__file__)


@pytest.fixture(scope="module")
def interp():
    """Our Triton modules, interpreted (with the interpreter patches of ``tests._testing``)."""
    pytest.importorskip("triton")
    with triton_interpreter_patches():
        from helixserve.kernels.attn_res import triton_attn_res
        from helixserve.kernels.mla import triton_mla
        from helixserve.kernels.moe import triton_route
        from helixserve.kernels.short_conv import triton_conv

        yield {"triton_mla": triton_mla, "triton_conv": triton_conv, "triton_attn_res": triton_attn_res,
               "triton_route": triton_route}


def _paged_cache(seq_lens, D, BS, num_blocks, seed, fill=float("nan")):
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-L // BS) for L in seq_lens) + 1
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for i, L in enumerate(seq_lens):
        for b in range(-(-L // BS)):
            tables[i, b] = free.pop()
    cache = torch.full((num_blocks, BS, D), fill)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(L) for L in seq_lens])
    latent = torch.randn(int(cu[-1]), D, generator=gen)
    return cache, tables, cu, positions, latent


@needs_interpreter
def test_mla_write_and_attention(interp):
    tm = interp["triton_mla"]
    H, V_DIM, D, BS = 5, 32, 40, 4
    seq_lens = [6, 1, 23, 11, 2]
    cache, tables, cu, positions, latent = _paged_cache(seq_lens, D, BS, num_blocks=32, seed=0)
    fast_cache = cache.clone()
    kernels.mla_write_kv(cache, tables, cu, positions, latent)
    tm.write_kv(fast_cache, tables, cu, positions, latent)
    assert torch.equal(cache.nan_to_num(7.0), fast_cache.nan_to_num(7.0))
    # decode: one query per sequence, odd blocks held on another helix rank, a kv_len of 0
    local = tables.clone()
    local[:, 1::2] = -1
    q = torch.randn(5, H, D)
    q_pos, kv_lens = torch.tensor([5, 0, 22, 7, 1]), torch.tensor([6, 1, 23, 11, 0])
    o_ref, lse_ref = kernels.mla_paged_attention(q, cache, local, torch.arange(6), q_pos, kv_lens, scale=0.1,
                                                 v_dim=V_DIM)
    # block_n 16 > BS: per-row gathered keys; block_n 4 == BS, 2 | BS: tiles inside one page
    # and value columns split over 2 or 4 programs, heads over 2 blocks of 4
    for num_splits, block_n, dv_parts, block_h in ((1, 16, 1, None), (3, 16, 2, 4), (1, 4, 4, None), (3, 2, 2, 4)):
        o, lse = tm.paged_attention(q, fast_cache, local, torch.arange(6), q_pos, kv_lens, 0.1, V_DIM,
                                    num_splits=num_splits, block_n=block_n, dv_parts=dv_parts, block_h=block_h)
        case = f"splits={num_splits} block_n={block_n} dv_parts={dv_parts} block_h={block_h}"
        assert_close(f"o {case}", o_ref, o, 1e-5)
        assert_close(f"lse {case}", lse_ref, lse, 1e-5)
    assert torch.isneginf(lse[4]).all() and torch.equal(o[4], torch.zeros(H, V_DIM))
    # prefill chunks: queries over the last rows of each sequence (causal inside the chunk)
    q_rows = torch.cat([torch.arange(max(0, L - 3), L) for L in seq_lens])
    cu_q = torch.tensor([0, *torch.tensor([min(3, L) for L in seq_lens]).cumsum(0).tolist()])
    q = torch.randn(q_rows.numel(), H, D)
    o_ref, lse_ref = kernels.mla_paged_attention(q, cache, tables, cu_q, q_rows, torch.tensor(seq_lens), scale=0.1,
                                                 v_dim=V_DIM)
    for dv_parts in (1, 2):
        o, lse = tm.paged_attention(q, fast_cache, tables, cu_q, q_rows, torch.tensor(seq_lens), 0.1, V_DIM,
                                    dv_parts=dv_parts)
        assert_close(f"prefill o dv_parts={dv_parts}", o_ref, o, 1e-5)
        assert_close(f"prefill lse dv_parts={dv_parts}", lse_ref, lse, 1e-5)


@needs_interpreter
def test_lse_combine(interp):
    o_parts, lse_parts = torch.randn(3, 4, 5, 24), torch.randn(3, 4, 5)
    lse_parts[:, 0, 0] = float("-inf")  # no part saw a key
    lse_parts[1, 1, 1] = float("-inf")
    o_parts[1, 1, 1] = float("nan")  # a weightless part's O must not leak
    o_ref, lse_ref = kernels.lse_combine(o_parts, lse_parts)
    o, lse = interp["triton_mla"].lse_combine(o_parts, lse_parts)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("lse", lse_ref, lse, 1e-6)


@needs_interpreter
def test_short_conv_step_and_prefill(interp):
    tc = interp["triton_conv"]
    D, W, S = 300, 4, 6
    weight = torch.randn(D, W)
    pool = torch.randn(S, D, W - 1)
    fast_pool = pool.clone()
    x, slots = torch.randn(3, D), torch.tensor([4, 0, 2])
    y_ref = kernels.short_conv_step(x, weight, pool, slots)
    y = tc.short_conv_step(x, weight, fast_pool, slots, "silu")
    assert_close("step y", y_ref, y, 1e-6)
    assert torch.equal(pool, fast_pool)  # updated slots and untouched ones alike
    # varlen prefill with a state, including sequences shorter than W - 1 and an empty one
    cu = torch.tensor([0, 5, 6, 6, 8])
    x, state = torch.randn(8, D), torch.randn(4, D, W - 1)
    for conv_state in (state, None):
        y_ref, new_ref = kernels.short_conv_prefill(x, weight, conv_state=conv_state, cu_seqlens=cu)
        y, new = tc.short_conv_prefill(x, weight, conv_state, cu, "silu")
        assert_close("prefill y", y_ref, y, 1e-6)
        assert_close("prefill state", new_ref, new, 1e-6)


@needs_interpreter
def test_attn_res_mix(interp):
    prefix, bank = torch.randn(7, 200), torch.randn(3, 7, 200) * 2
    norm_w, proj_w = torch.rand(200) + 0.5, torch.randn(1, 200)
    ref = kernels.attn_res_mix(prefix, bank, norm_w, proj_w, 1e-5)
    out = interp["triton_attn_res"].attn_res_mix(prefix, bank, norm_w, proj_w, 1e-5)
    assert_close("attn_res", ref, out, 1e-6)


@needs_interpreter
@pytest.mark.parametrize("bias", [True, False])
def test_moe_route(interp, bias):
    logits = torch.randn(9, 40)
    correction = torch.randn(40) * 0.1 if bias else None
    w_ref, ids_ref = kernels.moe_route(logits, top_k=6, correction_bias=correction, renormalize=True,
                                       routed_scaling_factor=2.5)
    w, ids = interp["triton_route"].moe_route(logits, 6, correction, True, 2.5)
    assert torch.equal(ids_ref, ids)
    assert_close("weights", w_ref, w, 1e-6)


@needs_interpreter
def test_fla_fused_recurrent_at_slots(interp):
    """fla's kernel through our adapter, states in place in our [S, H, K, V] pool."""
    pytest.importorskip("fla")
    from helixserve.kernels.kda import gpu as kda_gpu
    from helixserve.kernels.kda.recurrent import _recurrent_step_torch

    B, H, K, S = 3, 2, 32, 6
    q, k, v = torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, K)
    g, beta = -torch.rand(B, H, K), torch.rand(B, H)
    pool = torch.randn(S, H, K, K)
    fast_pool, slots = pool.clone(), torch.tensor([4, 0, 2])
    o_ref = _recurrent_step_torch(q, k, v, g, beta, pool, slots, K**-0.5, True)
    o = kda_gpu.recurrent_step(q, k, v, g, beta, fast_pool, slots, K**-0.5, True)
    assert kda_gpu._direct_launch  # launched fla's kernel directly, not through the fallback wrapper
    assert_close("o", o_ref, o, 1e-5)
    assert_close("pool", pool, fast_pool, 1e-5)


@pytest.mark.parametrize("path", ["grouped", "gathered"])
def test_moe_expert_paths_without_host_sync(path):
    """The GPU expert sums on CPU tensors (torch._grouped_mm has a CPU fallback); EP offsets too."""
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe.experts import _act_and_mul_torch, _moe_experts_torch

    if path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    dtype = torch.bfloat16 if path == "grouped" else torch.float32
    T, D, I, E, top_k = 13, 32, 16, 6, 3
    x = torch.randn(T, D).to(dtype)
    w13, w2 = (torch.randn(E, 2 * I, D) / 6).to(dtype), (torch.randn(E, D, I) / 4).to(dtype)
    weights, ids = kernels.moe_route(torch.randn(T, 10), top_k=top_k, correction_bias=None, renormalize=True,
                                     routed_scaling_factor=1.0)
    fn = moe_gpu.grouped_experts if path == "grouped" else moe_gpu.gathered_experts

    def act(gate, up):
        return _act_and_mul_torch(gate, up, "situ", 4.0, 25.0)

    for offset in (0, 4):  # offset 4: experts 4..9 local, the rest routed elsewhere
        ref = _moe_experts_torch(x, ids, weights, w13, w2, offset, "situ", 4.0, 25.0)
        out = fn(x, ids, weights, w13, w2, offset, act)
        assert_close(f"{path} offset={offset}", ref.float(), out.float(), 1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_interpreter
@pytest.mark.parametrize("word", [16, 8, 4, 2, 1])
def test_unit_copy(interp, word, monkeypatch):
    """Groups of every alignment (the widest word that divides every offset, size and tensor
    address; 16 bytes: int64 pairs), units cut into chunks (a small CHUNK_BYTES, sizes that do not
    divide), one to three groups over several tensors: byte-equal to the unit-by-unit reference."""
    import numpy as np

    from helixserve.kernels.copy.units import UnitGroup, unit_copy_reference  # first: it imports triton_units
    from helixserve.kernels.copy import triton_units  # noqa: I001

    monkeypatch.setattr(triton_units, "CHUNK_BYTES", 96)
    gen = torch.Generator().manual_seed(word)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (4096, 2048)]
    dsts = [torch.zeros(8192, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)]

    def group(unit: int, segments: list, units: list) -> UnitGroup:
        return UnitGroup(unit * word, np.asarray(segments, dtype=np.int64), np.asarray(units, dtype=np.int64) * word)

    groups = [group(13, [[0, 0], [1, 1]], [[0, 0], [40, 20], [3, 60]]),  # 13 words: chunks of 96 bytes
              group(1, [[1, 0]], [[7, 100]]),
              group(5, [[0, 1], [1, 0]], [[11, 150], [30, 170]])]
    for n in (1, 2, 3):
        for d in dsts:
            d.zero_()
        want = [d.clone() for d in dsts]
        unit_copy_reference(srcs, want, groups[:n])
        _, _, got_word, vec = triton_units.pack(srcs, dsts, groups[:n])
        assert (got_word * vec == word) if word == 16 else (got_word == word and vec == 1)
        triton_units.unit_copy(srcs, dsts, groups[:n])
        for w, d in zip(want, dsts):
            assert torch.equal(w, d)
        if word >= 8:  # the prepared path (segment rows kept, only the units sent): the same bytes
            for d in dsts:
                d.zero_()
            table = triton_units.SegmentTable(srcs, dsts, [g.segments for g in groups])
            assert triton_units.copy_prepared(table, groups[:n])
            for w, d in zip(want, dsts):
                assert torch.equal(w, d)
            # what a graph replays: every group of the table (the ones left out without units)
            # and a fixed grid of 2 programs, each looping over the work items
            for d in dsts:
                d.zero_()
            rows, programs = triton_units.request_table(table.every_group(groups[:n]), table.starts, got_word, vec)
            assert programs > 2 and rows[0] == programs
            # written in place (a graph slot's pinned buffer): the same words, the buffer's tail untouched
            every = table.every_group(groups[:n])
            out = np.full(triton_units.request_table_size(every) + 5, -7, dtype=np.int64)
            in_place, same = triton_units.request_table(every, table.starts, got_word, vec, out=out)
            assert same == programs and np.array_equal(in_place, rows) and (out[rows.size :] == -7).all()
            # a group's known alignment (a stride its offsets are multiples of) picks the same words
            aligned = [UnitGroup(g.unit_bytes, g.segments, g.units, align=word) for g in groups[:n]]
            assert triton_units._words(table.bits, aligned) == triton_units._words(table.bits, groups[:n])
            triton_units._launch(table.rows, torch.from_numpy(rows), 2, got_word, vec, len(groups), srcs[0], dsts[0])
            for w, d in zip(want, dsts):
                assert torch.equal(w, d)
        else:  # words narrower than 8 bytes: the prepared path declines, nothing is written
            table = triton_units.SegmentTable(srcs, dsts, [g.segments for g in groups])
            before = [d.clone() for d in dsts]
            assert not triton_units.copy_prepared(table, groups[:n])
            assert all(torch.equal(b, d) for b, d in zip(before, dsts))
