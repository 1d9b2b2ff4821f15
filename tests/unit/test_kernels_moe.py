"""MoE routing, gated activations and the expert sum (incl. expert-parallel split)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helixserve.kernels import act_and_mul, moe_experts, moe_route
from helixserve.kernels.moe.naive import naive_moe_experts, naive_moe_route
from tests._testing import assert_close

T, D, I, E, TOP_K = 11, 8, 6, 8, 3


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def route(bias=None, renormalize=True, scaling=2.446, seed=0):
    return moe_route(rand(T, E, seed=seed), top_k=TOP_K, correction_bias=bias, renormalize=renormalize,
                     routed_scaling_factor=scaling)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_naive(renormalize):
    logits, bias = rand(T, E, seed=0), rand(E, seed=1)
    w, ids = moe_route(logits, top_k=TOP_K, correction_bias=bias, renormalize=renormalize,
                       routed_scaling_factor=2.446)
    w_ref, ids_ref = naive_moe_route(logits, TOP_K, bias, renormalize, 2.446)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ids_ref)
    assert_close("weights", w_ref, w, 1e-6)


def test_bias_changes_selection_not_weights():
    bias = torch.zeros(E)
    bias[5] = 10.0  # forces expert 5 in
    w, ids = route(bias, renormalize=False, scaling=1.0)
    assert (ids == 5).any(-1).all()
    scores = torch.sigmoid(rand(T, E, seed=0))
    assert torch.equal(w, scores.gather(1, ids)), "weights are the unbiased sigmoid scores"
    _, ids_plain = route(None)
    assert not torch.equal(ids, ids_plain)


def test_renormalize_then_scale():
    w, _ = route(None, renormalize=True, scaling=2.5)
    assert_close("row sums", torch.full((T,), 2.5), w.sum(-1), 1e-6)
    w1, _ = route(None, renormalize=False, scaling=1.0)
    w3, _ = route(None, renormalize=False, scaling=3.0)
    assert_close("scaling", w1 * 3.0, w3, 1e-7)


def test_act_and_mul_formulas():
    gate, up = rand(5, I, seed=2) * 20, rand(5, I, seed=3) * 60  # reach both tanh soft-caps
    assert_close("silu", F.silu(gate) * up, act_and_mul(gate, up), 1e-7)
    situ = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * (25.0 * torch.tanh(up / 25.0))
    assert_close("situ", situ, act_and_mul(gate, up, activation="situ"), 1e-7)
    out = act_and_mul(gate.bfloat16(), up.bfloat16(), activation="situ", situ_beta=2.0, situ_linear_beta=10.0)
    assert out.dtype == torch.bfloat16
    assert out.float().abs().max() <= 2.0 * 10.0 + 0.1


@pytest.fixture(params=["few_pairs", "grouped"])
def expert_path(request, monkeypatch):
    """Both expert-sum paths: pairs grouped on the host (decode sizes) and the sorted grouping."""
    import helixserve.kernels.moe.experts as experts

    monkeypatch.setattr(experts, "_FEW_PAIRS", 64 if request.param == "few_pairs" else 0)
    return request.param


@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_experts_match_naive_and_split_halves_sum(activation, expert_path):
    x = rand(T, D, seed=4)
    w, ids = route(rand(E, seed=5))
    w13, w2 = rand(E, 2 * I, D, seed=6), rand(E, D, I, seed=7)
    y = moe_experts(x, ids, w, w13, w2, activation=activation)
    assert_close("vs naive", naive_moe_experts(x, ids, w, w13, w2, activation=activation), y, 1e-6)
    half = E // 2
    y_lo = moe_experts(x, ids, w, w13[:half], w2[:half], expert_offset=0, activation=activation)
    y_hi = moe_experts(x, ids, w, w13[half:], w2[half:], expert_offset=half, activation=activation)
    assert_close("EP halves", y, y_lo + y_hi, 1e-6)


def test_experts_single_token(expert_path):
    x = rand(1, D, seed=11)
    w, ids = moe_route(rand(1, E, seed=12), top_k=TOP_K, correction_bias=None, renormalize=True,
                       routed_scaling_factor=2.0)
    w13, w2 = rand(E, 2 * I, D, seed=13), rand(E, D, I, seed=14)
    assert_close("T=1", naive_moe_experts(x, ids, w, w13, w2), moe_experts(x, ids, w, w13, w2), 1e-6)


def test_experts_no_local_expert_and_bf16(expert_path):
    x = rand(T, D, seed=8, dtype=torch.bfloat16)
    w, ids = route()
    w13, w2 = rand(2, 2 * I, D, seed=9, dtype=torch.bfloat16), rand(2, D, I, seed=10, dtype=torch.bfloat16)
    y_none = moe_experts(x, ids, w, w13, w2, expert_offset=E)  # every id outside [E, E+2)
    assert y_none.dtype == torch.bfloat16 and torch.equal(y_none, torch.zeros(T, D, dtype=torch.bfloat16))
    y = moe_experts(x, ids, w, w13, w2, expert_offset=3)
    assert_close("bf16", naive_moe_experts(x, ids, w, w13, w2, expert_offset=3), y.float(), 1e-2)


def test_rejects_bad_arguments():
    x, (w, ids) = rand(T, D, seed=0), route()
    w13, w2 = rand(E, 2 * I, D, seed=1), rand(E, D, I, seed=2)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(rand(T, E, seed=0), top_k=E + 1, correction_bias=None, renormalize=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        moe_route(rand(T, E, seed=0), top_k=2, correction_bias=torch.zeros(E - 1), renormalize=True,
                  routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="w13 must be"):
        moe_experts(x, ids, w, w13[:, :-1], w2)
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe_experts(x, ids, w, w13, w2[:, :, :-1])
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        moe_experts(x, ids, w[:, :1], w13, w2)
    with pytest.raises(ValueError, match="topk_ids must be an integer"):
        moe_experts(x, ids.float(), w, w13, w2)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, ids, w, w13, w2, activation="gelu")
    with pytest.raises(ValueError, match="up must have shape"):
        act_and_mul(torch.zeros(2, I), torch.zeros(2, I + 1))


@pytest.mark.parametrize("form,layout", [  # the bag form reads column-major stacks only
    ("grouped_mm", "row_major"), ("grouped_mm", "column_major"), ("padded_bmm", "row_major"),
    ("padded_bmm", "column_major"), ("bag", "column_major"),
])
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_few_pairs_grouped_gemm_matches_per_expert_loop(monkeypatch, form, layout, activation):
    """fp32 stacks with 16-byte aligned rows take torch._grouped_mm (or one bmm over every local
    expert, padded) on the host-sorted pairs, or (column-major stacks) two weighted embedding bags:
    the same sum as the per-expert loop and the naive reference, also for an expert-parallel half."""
    import helixserve.kernels.moe.experts as experts

    monkeypatch.setattr(experts, "_prefers_padded_bmm", lambda counts: form == "padded_bmm")
    if form != "bag":
        monkeypatch.setattr(experts, "_can_bag", lambda *args: False)

    t, d, i = 9, 16, 8
    x = rand(t, d, seed=21)
    w, ids = moe_route(rand(t, E, seed=22), top_k=TOP_K, correction_bias=None, renormalize=True,
                       routed_scaling_factor=2.0)
    w13, w2 = rand(E, 2 * i, d, seed=23), rand(E, d, i, seed=24)
    if layout == "column_major":
        w13, w2 = (wt.transpose(1, 2).contiguous().transpose(1, 2) for wt in (w13, w2))
    assert experts._can_group_on_host(x, w13, w2)
    assert experts._can_bag(x, w13, w2) == (form == "bag")
    grouped = moe_experts(x, ids, w, w13, w2, activation=activation)
    half = moe_experts(x, ids, w, w13[E // 2:], w2[E // 2:], expert_offset=E // 2, activation=activation)
    monkeypatch.setattr(experts, "_can_group_on_host", lambda *args: False)
    monkeypatch.setattr(experts, "_can_bag", lambda *args: False)
    looped = moe_experts(x, ids, w, w13, w2, activation=activation)
    assert_close("vs loop", looped, grouped, 1e-6)
    assert_close("vs naive", naive_moe_experts(x, ids, w, w13, w2, activation=activation), grouped, 1e-6)
    assert_close("EP half", naive_moe_experts(x, ids, w, w13[E // 2:], w2[E // 2:], expert_offset=E // 2,
                                              activation=activation), half, 1e-6)


def test_bag_form_needs_column_major_fp32_stacks_and_skips_one_token(monkeypatch):
    """The bag form reads the column-major stacks as row tables (row-major or bf16 stacks would need a
    copy of the whole stack); one token keeps the per-expert GEMMs."""
    import helixserve.kernels.moe.experts as experts

    x = rand(4, D, seed=30)
    w13, w2 = rand(E, 2 * I, D, seed=31), rand(E, D, I, seed=32)
    cols = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w13, w2)]
    assert experts._can_bag(x, *cols) and not experts._can_bag(x, w13, w2)
    assert not experts._can_bag(x.bfloat16(), *(t.bfloat16() for t in cols))
    called = []
    monkeypatch.setattr(experts, "_bag_experts", lambda *args: called.append(args) or args[0])
    w, ids = moe_route(rand(1, E, seed=33), top_k=TOP_K, correction_bias=None, renormalize=True,
                       routed_scaling_factor=1.0)
    moe_experts(x[:1], ids, w, *cols)
    assert not called


def test_padded_bmm_only_with_threads_and_busy_experts(monkeypatch):
    import helixserve.kernels.moe.experts as experts

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert experts._prefers_padded_bmm([1, 0, 2, 1]) and not experts._prefers_padded_bmm([1, 0, 0, 0, 3, 0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not experts._prefers_padded_bmm([1, 1, 1, 1])


@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("form", ["gathered", "grouped", "dense"])
def test_gpu_expert_forms_match_naive_on_any_row_count(form, rows):
    """The GPU path's two expert forms are plain torch: checked here on the CPU, including a rank
    that receives no rows from the token-sliced all-to-all (T = 0) and an EP slice of the experts."""
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe.experts import _act_and_mul_torch

    dtype = torch.bfloat16 if form == "grouped" else torch.float32
    d, i = 16, 8  # 16-byte aligned rows, as torch._grouped_mm needs
    x = rand(rows, d, seed=20, dtype=dtype)
    w, ids = moe_route(rand(rows, E, seed=21), top_k=TOP_K, correction_bias=None, renormalize=True,
                       routed_scaling_factor=1.0)
    w13, w2 = rand(E // 2, 2 * i, d, seed=22, dtype=dtype), rand(E // 2, d, i, seed=23, dtype=dtype)
    if form == "grouped" and not moe_gpu.can_group(x, w13, w2):
        pytest.fail("torch._grouped_mm should be usable for bf16 here")

    def act(gate, up):
        return _act_and_mul_torch(gate, up, "silu", 1.0, 1.0)

    fn = {"grouped": moe_gpu.grouped_experts, "gathered": moe_gpu.gathered_experts,
          "dense": moe_gpu.dense_experts}[form]
    y = fn(x, ids, w, w13, w2, E // 2, act)
    assert y.shape == (rows, d) and y.dtype == dtype
    want = naive_moe_experts(x.float(), ids, w, w13.float(), w2.float(), expert_offset=E // 2)
    assert_close(f"{form} T={rows}", want, y.float(), 1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("expert_offset", [0, 4])
def test_dense_experts_equal_the_sorted_path_without_host_reads(expert_offset):
    """The every-expert form (CUDA fp32 past the gathered form's memory bound) against the sorted
    PyTorch path it stands in for, on more pairs than the few-pairs paths take (T * k > 64), with
    an EP slice; under the guard that fails any host read or value-dependent shape (what a CUDA
    graph capture cannot hold)."""
    from helixserve.kernels.moe import gpu as moe_gpu
    from helixserve.kernels.moe.experts import _act_and_mul_torch, _moe_experts_torch
    from tests.integration.host_sync_guard import HostReadError, no_host_reads

    rows, d, i = 40, 16, 8
    x = rand(rows, d, seed=30)
    w, ids = moe_route(rand(rows, E, seed=31), top_k=TOP_K, correction_bias=None, renormalize=True,
                       routed_scaling_factor=2.446)
    w13, w2 = rand(E // 2, 2 * i, d, seed=32), rand(E // 2, d, i, seed=33)
    want = _moe_experts_torch(x, ids, w, w13, w2, expert_offset, "situ", 4.0, 25.0)
    with no_host_reads():
        y = moe_gpu.dense_experts(x, ids, w, w13, w2, expert_offset,
                                  lambda g, u: _act_and_mul_torch(g, u, "situ", 4.0, 25.0))
        with pytest.raises(HostReadError):  # the guard is live: the sorted path reads the routing
            _moe_experts_torch(x, ids, w, w13, w2, expert_offset, "situ", 4.0, 25.0)
    assert want.abs().sum() > 0
    assert_close(f"dense vs sorted, offset {expert_offset}", want, y, 1e-6)


def test_pair_sum_is_the_scatter_sum_in_a_fixed_per_token_order():
    """The GPU expert forms' combine: pairs back in (token, k) order, summed over k in turn; equal
    to the ``index_add_`` it replaces (atomic adds on CUDA), and each token's row is bit-identical
    whatever other tokens share the batch. Group ends by binary search equal the counted ones."""
    from helixserve.kernels.moe import gpu as moe_gpu

    rows, top_k, d = 13, TOP_K, 16
    w, ids = moe_route(rand(rows, E, seed=40), top_k=top_k, correction_bias=None, renormalize=True,
                       routed_scaling_factor=1.0)
    order, sorted_ids, _ = moe_gpu._sort_pairs(ids, E - 2, 1)  # an EP slice: some pairs held elsewhere
    y = rand(rows * top_k, d, seed=41) * 1e3
    scattered = torch.zeros(rows, d).index_add_(0, order // top_k, y)
    summed = moe_gpu.sum_pairs(y, order, top_k)
    assert_close("pair sum vs index_add_", scattered, summed, 1e-6)
    for t in (0, 5, rows - 1):  # token t alone: its k pairs only, in their sorted order
        mine = torch.nonzero(order // top_k == t).squeeze(1)
        alone = moe_gpu.sum_pairs(y[mine], order[mine] - t * top_k, top_k)
        assert torch.equal(alone[0], summed[t])
    counts = torch.bincount(sorted_ids, minlength=E - 1)[:E - 2]
    assert torch.equal(moe_gpu.group_ends(sorted_ids, E - 2), torch.cumsum(counts, 0).to(torch.int32))
