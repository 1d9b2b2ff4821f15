"""FlashMLA decode (the optional backend of mla_paged_attention) on an sm90 GPU == the fp32 PyTorch
reference and our Triton kernel: H 64 / 96 / 128, ragged kv lengths (1, not multiples of 64), NaN
sentinels in unused cache memory, helix ``-1`` entries and rows with no key, and a CUDA-graph
capture replayed on new inputs. Skipped without CUDA or without the library (``make flashmla``)."""

from __future__ import annotations

import pytest
import torch

from helixserve import kernels
from helixserve.kernels.mla import flashmla
from helixserve.kernels.triton_common import has_triton
from tests._testing import assert_close

pytestmark = pytest.mark.gpu
CUDA = "cuda"
D, V_DIM, PAGE = 576, 512, 64
SCALE = D**-0.5
SEQ_LENS = [1, 63, 65, 300, 1000, 129, 2047, 64]


@pytest.fixture(autouse=True)
def needs_flashmla():
    flashmla.reset()
    reason = flashmla.unavailable_reason(torch.device(CUDA))
    if reason is not None:
        pytest.skip(reason)
    yield
    flashmla.reset()


def decode_inputs(seq_lens: list[int], H: int, seed: int, *, spare_blocks: int = 3):
    """CPU tensors: q [B, H, 576] bf16, a NaN-filled bf16 cache of shuffled 64-token pages holding each
    sequence's keys, block tables (-1 past each sequence), kv_lens."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-L // PAGE) for L in seq_lens) + 1
    num_blocks = sum(-(-L // PAGE) for L in seq_lens) + spare_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cache = torch.full((num_blocks, PAGE, D), float("nan"), dtype=torch.bfloat16)
    for i, L in enumerate(seq_lens):
        keys = torch.randn(L, D, generator=gen).to(torch.bfloat16)
        for b in range(-(-L // PAGE)):
            tables[i, b] = free.pop()
            rows = keys[b * PAGE:(b + 1) * PAGE]
            cache[tables[i, b], :rows.shape[0]] = rows
    q = torch.randn(len(seq_lens), H, D, generator=gen).to(torch.bfloat16)
    return q, cache, tables, torch.tensor(seq_lens)


def reference(q, cache, tables, kv_lens):
    """The PyTorch reference of mla_paged_attention on CPU, in fp32: (o [B, H, 512], lse [B, H])."""
    B = q.shape[0]
    return kernels.mla_paged_attention(q.float(), cache.float(), tables, torch.arange(B + 1), kv_lens - 1, kv_lens,
                                       scale=SCALE, v_dim=V_DIM)


def on_gpu(*tensors: torch.Tensor):
    return tuple(t.to(CUDA) for t in tensors)


def check_against(name: str, o_ref: torch.Tensor, lse_ref: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    atol = 2e-2 * max(1.0, float(o_ref.abs().max()))
    assert_close(f"{name} o", o_ref.float(), o.float().cpu(), 2e-2, atol=atol)
    assert_close(f"{name} lse", lse_ref.float(), lse.cpu(), 1e-3, atol=1e-2)


@pytest.mark.parametrize("H", [64, 96, 128])
@pytest.mark.parametrize("helix", [False, True])
def test_flashmla_matches_reference_and_triton(H, helix):
    q, cache, tables, kv_lens = decode_inputs(SEQ_LENS, H, seed=H)
    if helix:  # odd logical blocks on another rank; a row with no key; a fully remote row
        tables[:, 1::2] = -1
        kv_lens[3] = 0
        tables[5] = -1
    o_ref, lse_ref = reference(q, cache, tables, kv_lens)
    gq, gcache, gtables, glens = on_gpu(q, cache, tables, kv_lens)
    o, lse = flashmla.paged_decode(gq, gcache, gtables, glens, SCALE)
    check_against("flashmla", o_ref, lse_ref, o, lse)
    no_key = torch.isneginf(lse_ref)
    if helix:
        assert no_key[3].all() and no_key[5].all()
        assert torch.equal(o[no_key.to(CUDA)].float(), torch.zeros_like(o[no_key.to(CUDA)].float()))
    # the public function, declared a decode, dispatches to FlashMLA: the same bits
    cu = torch.arange(len(SEQ_LENS) + 1, device=CUDA)
    o_pub, lse_pub = kernels.mla_paged_attention(gq, gcache, gtables, cu, glens - 1, glens, scale=SCALE,
                                                 v_dim=V_DIM, is_decode=True)
    assert torch.equal(o_pub, o) and torch.equal(lse_pub, lse)
    if has_triton():
        from helixserve.kernels.mla import triton_mla

        o_tr, lse_tr = triton_mla.paged_attention(gq, gcache, gtables, cu, glens - 1, glens, SCALE, V_DIM)
        check_against("flashmla vs triton", o_tr.float().cpu(), lse_tr.cpu(), o, lse)


def test_dispatch_follows_the_setting(monkeypatch):
    q, cache, tables, kv_lens = on_gpu(*decode_inputs([70, 1, 300], 64, seed=3))
    cu = torch.arange(4, device=CUDA)
    calls = []
    real = flashmla.paged_decode
    monkeypatch.setattr(flashmla, "paged_decode", lambda *a: calls.append(1) or real(*a))
    args = (q, cache, tables, cu, kv_lens - 1, kv_lens)
    kernels.mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    assert len(calls) == 1
    kernels.mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM)  # not declared a decode
    assert len(calls) == 1
    monkeypatch.setenv("HELIXSERVE_MLA_BACKEND", "triton")
    flashmla.setting.cache_clear()
    kernels.mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    assert len(calls) == 1
    small_pages = cache.view(-1, 16, D)  # 16-token pages: FlashMLA cannot, the call falls back
    with pytest.raises(flashmla.FlashMLAShapeError, match="pages"):
        real(q, small_pages, tables, kv_lens, SCALE)


def test_cuda_graph_capture_and_replay_on_new_inputs():
    H, B = 128, 6
    lens_a, lens_b = [1, 65, 300, 129, 2000, 64], [2, 64, 1, 777, 1999, 1]
    q, cache, tables, _ = decode_inputs([max(a, b) for a, b in zip(lens_a, lens_b)], H, seed=5)
    s_q, s_cache, s_tables, s_lens = on_gpu(q, cache, tables, torch.tensor(lens_a))
    cu = torch.arange(B + 1, device=CUDA)

    def step():
        return kernels.mla_paged_attention(s_q, s_cache, s_tables, cu, s_lens - 1, s_lens, scale=SCALE,
                                           v_dim=V_DIM, is_decode=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: library load, device selection, workspace sizes
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = step()
    # new inputs in place: other queries, other lengths, the last row a padding row (nothing held)
    q2 = torch.randn(B, H, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    tables2 = tables.clone()
    tables2[-1] = -1
    s_q.copy_(q2.to(CUDA))
    s_lens.copy_(torch.tensor(lens_b))
    s_tables.copy_(tables2.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, lse_ref = reference(q2, cache, tables2, torch.tensor(lens_b))
    check_against("graph replay", o_ref, lse_ref, o_graph, lse_graph)
    assert torch.isneginf(lse_graph[-1]).all() and float(o_graph[-1].float().abs().max()) == 0.0
    o_eager, lse_eager = step()
    assert torch.equal(o_eager, o_graph) and torch.equal(lse_eager, lse_graph)
