"""KDA kernels against the loop reference, fla's naive forms and transformers' gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helixserve.kernels import kda_chunk_prefill, kda_gate, kda_recurrent_step
from helixserve.kernels.kda.naive import l2norm_fp32, naive_kda_gate, naive_recurrent_kda
from tests._testing import assert_close, load_functions_from_source, load_module_by_path

H, K, V = 2, 16, 8


@pytest.fixture(scope="module")
def fla_naive():
    return load_module_by_path("fla", "ops/kda/naive.py")


@pytest.fixture(scope="module")
def fla_gates():
    return load_functions_from_source(
        "fla", "ops/kda/gate.py", ["naive_kda_gate", "naive_kda_lowerbound_gate"], {"torch": torch, "F": F}
    )


def make_inputs(T: int, seed: int, *, lower_bound: float | None = -5.0, dtype=torch.float32):
    """q, k, v, g, beta like the model produces them (k unit-norm, g from the gate)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = F.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, H, V, generator=gen)
    f = torch.randn(T, H * K, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    g = kda_gate(f, A_log, dt_bias, num_heads=H, head_dim=K, lower_bound=lower_bound)
    beta = torch.rand(T, H, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def fla_recurrent(fla_naive, q, k, v, g, beta, initial_state=None):
    o, S = fla_naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None],
                                         initial_state=initial_state, output_final_state=True)
    return o[0], S


@pytest.mark.parametrize("T", [1, 17, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_prefill_matches_recurrent_references(fla_naive, T, with_state):
    q, k, v, g, beta = make_inputs(T, seed=T)
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(1)) if with_state else None
    o, S = kda_chunk_prefill(q, k, v, g, beta, initial_state=h0)
    o_naive, S_naive = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o_fla, S_fla = fla_recurrent(fla_naive, q, k, v, g, beta, h0)
    assert o.dtype == v.dtype and S.dtype == torch.float32
    assert_close("o vs naive", o_naive, o, 1e-5)
    assert_close("S vs naive", S_naive, S, 1e-5)
    assert_close("o vs fla", o_fla, o, 1e-5)
    assert_close("S vs fla", S_fla, S, 1e-5)


def test_chunk_prefill_matches_transformers_torch_chunk():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta = make_inputs(100, seed=2)
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(2))
    o_ref, S_ref = modeling.chunk_kimi_delta_attention(
        q[None], k[None] * 2, v[None], g[None], beta[None], initial_state=h0.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    o, S = kda_chunk_prefill(q, k * 2, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert_close("o", o_ref[0], o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


@pytest.mark.parametrize("chunk_size", [1, 16, 48])
def test_chunk_size_does_not_change_result(chunk_size):
    q, k, v, g, beta = make_inputs(70, seed=3)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    o, S = kda_chunk_prefill(q, k, v, g, beta, chunk_size=chunk_size)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


def test_intra_chunk_batching_does_not_change_result(monkeypatch):
    import helixserve.kernels.kda.chunk as chunk

    cu = torch.tensor([0, 20, 45, 90])
    q, k, v, g, beta = make_inputs(90, seed=30)
    o_ref, S_ref = kda_chunk_prefill(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    monkeypatch.setattr(chunk, "_MAX_PAIRWISE_ELEMENTS", 3 * 16 * 16 * K)  # 3 (chunk, head) pairs per batch
    o, S = kda_chunk_prefill(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("S", S_ref, S, 1e-6)


def test_strong_decay_stays_finite():
    # g ~ -5 per token: the in-chunk cumulative decay reaches ~-320, exp(+320) would overflow fp32
    q, k, v, _, beta = make_inputs(128, seed=4)
    g = torch.full((128, H, K), -4.9)
    g[::7] = -0.01
    o, S = kda_chunk_prefill(q, k, v, g, beta)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


def test_varlen_matches_per_segment(fla_naive):
    cu = torch.tensor([0, 1, 18, 82, 130, 130, 230], dtype=torch.int64)
    T, N = int(cu[-1]), cu.numel() - 1
    q, k, v, g, beta = make_inputs(T, seed=5)
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(6))
    o, S = kda_chunk_prefill(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        o_ref, S_ref = fla_recurrent(fla_naive, q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], h0[n:n + 1])
        assert_close(f"o seq {n}", o_ref, o[s:e], 1e-5)
        assert_close(f"S seq {n}", S_ref[0], S[n], 1e-5)


def test_naive_recurrent_matches_fla_naive_chunk(fla_naive):
    q, k, v, g, beta = make_inputs(128, seed=7)
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(8))
    o_chunk, S_chunk = fla_naive.naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=h0, output_final_state=True)
    o_naive, S_naive = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert_close("o", o_chunk[0], o_naive, 1e-5)
    assert_close("S", S_chunk, S_naive, 1e-5)


def test_qk_l2norm_and_scale(fla_naive):
    q, k, v, g, beta = make_inputs(40, seed=9)
    k = k * 3.0
    o, S = kda_chunk_prefill(q, k, v, g, beta, use_qk_l2norm=True, scale=0.5, chunk_size=16)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(l2norm_fp32(q)[None], l2norm_fp32(k)[None], v[None], g[None],
                                                 beta[None], scale=0.5, output_final_state=True)
    assert_close("o", o_ref[0], o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


def test_bf16_inputs_return_bf16():
    q, k, v, g, beta = make_inputs(50, seed=10, dtype=torch.bfloat16)
    o, S = kda_chunk_prefill(q, k, v, g, beta)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_close("o", o_ref.float(), o.float(), 5e-3)
    assert_close("S", S_ref, S, 1e-5)


def test_prefill_then_decode_steps_match_full_prefill():
    T, n_prefill = 40, 29
    q, k, v, g, beta = make_inputs(T, seed=11)
    o_full, S_full = kda_chunk_prefill(q, k, v, g, beta, use_qk_l2norm=True)
    _, S_pre = kda_chunk_prefill(q[:n_prefill], k[:n_prefill], v[:n_prefill], g[:n_prefill], beta[:n_prefill],
                                 use_qk_l2norm=True)
    pool = torch.full((4, H, K, V), float("nan"))
    pool[2] = S_pre[0]
    slot = torch.tensor([2])
    for t in range(n_prefill, T):
        o_t = kda_recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool, slot,
                                 use_qk_l2norm=True)
        assert_close(f"o[{t}]", o_full[t:t + 1], o_t, 1e-5)
    assert_close("state", S_full[0], pool[2], 1e-5)
    assert torch.isnan(pool[[0, 1, 3]]).all(), "other slots must stay untouched"


def test_decode_step_batch_with_scattered_slots():
    B = 3
    q, k, v, g, beta = make_inputs(B, seed=12)
    pool = torch.randn(6, H, K, V, generator=torch.Generator().manual_seed(13))
    before = pool.clone()
    slots = torch.tensor([5, 0, 3])
    o = kda_recurrent_step(q, k, v, g, beta, pool, slots)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=before[slots],
                                       cu_seqlens=torch.arange(B + 1))
    assert_close("o", o_ref, o, 1e-5)
    assert_close("states", S_ref, pool[slots], 1e-5)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


def test_prefill_reads_only_its_rows():
    # inputs are views into larger buffers whose tail is a sentinel
    T = 33
    q, k, v, g, beta = make_inputs(T, seed=14)

    def padded(x, fill):
        buf = torch.full((T + 16, *x.shape[1:]), fill, dtype=x.dtype)
        buf[:T] = x
        return buf[:T]

    o, S = kda_chunk_prefill(padded(q, 1e30), padded(k, float("nan")), padded(v, 1e30), padded(g, float("nan")),
                             padded(beta, 1e30))
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("a_log_shape", ["heads", "hf_4d", "padded_128"])
def test_gate_matches_fla(fla_gates, lower_bound, a_log_shape):
    T = 9
    gen = torch.Generator().manual_seed(15)
    f = torch.randn(T, H * K, generator=gen, dtype=torch.bfloat16)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    stored = {"heads": A_log, "hf_4d": A_log.view(1, 1, H, 1),
              "padded_128": torch.cat([A_log, torch.zeros(128 - H)])}[a_log_shape]
    g = kda_gate(f, stored, dt_bias, num_heads=H, head_dim=K, lower_bound=lower_bound)
    f3 = f.view(T, H, K)
    if lower_bound is None:
        ref = fla_gates["naive_kda_gate"](f3, A_log, dt_bias)
    else:
        ref = fla_gates["naive_kda_lowerbound_gate"](f3, A_log, dt_bias, lower_bound=lower_bound)
    assert g.shape == (T, H, K) and g.dtype == torch.float32
    assert_close("g vs fla", ref, g, 1e-6)
    assert_close("g vs loop", naive_kda_gate(f, stored, dt_bias, H, K, lower_bound), g, 1e-6)
    assert (g <= 0).all()
    if lower_bound is not None:
        assert (g >= lower_bound).all()


def test_gate_matches_transformers_forget_gate():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(
        hidden_size=32, num_hidden_layers=2,
        linear_attn_config={"head_dim": K, "num_heads": H, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": [2]},
    )
    torch.manual_seed(16)
    gate = modeling.KimiLinearForgetGate(config)
    for p in gate.parameters():
        torch.nn.init.normal_(p, std=2.0)  # large f exercises HF's softplus > 20 branch
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        ref = gate(x)
        f = gate.f_b_proj(gate.f_a_proj(x))[0]
    g = kda_gate(f, gate.A_log.detach(), gate.dt_bias.detach(), num_heads=H, head_dim=K)
    assert_close("g", ref[0], g, 1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(k=a["k"][:, :, :-1]), "k must have shape"),
        (lambda a: a.update(v=a["v"][:-1]), "v must be"),
        (lambda a: a.update(g=a["g"][None]), "g must be 3-D"),
        (lambda a: a.update(beta=a["beta"][:, :1]), "beta must have shape"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 5, 9])), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 6, 4, 10])), "non-decreasing"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 10.0])), "integer"),
        (lambda a: a.update(initial_state=torch.zeros(2, H, K, V)), "initial_state"),
        (lambda a: a.update(chunk_size=0), "chunk_size"),
    ],
)
def test_chunk_prefill_rejects_bad_arguments(change, match):
    q, k, v, g, beta = make_inputs(10, seed=0)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    change(args)
    tensors = {name: args.pop(name) for name in ("q", "k", "v", "g", "beta")}
    with pytest.raises(ValueError, match=match):
        kda_chunk_prefill(*tensors.values(), **args)


def test_step_and_gate_reject_bad_arguments():
    q, k, v, g, beta = make_inputs(2, seed=0)
    pool = torch.zeros(3, H, K, V)
    with pytest.raises(ValueError, match="slot_ids must lie"):
        kda_recurrent_step(q, k, v, g, beta, pool, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="repeat"):
        kda_recurrent_step(q, k, v, g, beta, pool, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="state_pool must be"):
        kda_recurrent_step(q, k, v, g, beta, torch.zeros(3, H, V, K), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="state_pool must have dtype"):
        kda_recurrent_step(q, k, v, g, beta, pool.bfloat16(), torch.tensor([0, 1]))
    f = torch.zeros(2, H * K)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(H - 1), torch.zeros(H * K), num_heads=H, head_dim=K)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, torch.zeros(H), torch.zeros(K), num_heads=H, head_dim=K)
    with pytest.raises(ValueError, match="f must be"):
        kda_gate(f, torch.zeros(H), torch.zeros(H * K), num_heads=H + 1, head_dim=K)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, torch.zeros(H), torch.zeros(H * K), num_heads=H, head_dim=K, lower_bound=5.0)


@pytest.mark.parametrize("batch", [1, 5])
def test_decode_step_with_q_k_v_from_one_projection(batch):
    """q | k | v as views of one [B, 3, H, K] tensor (the model's layout: q and k normed in one pass)
    give the same bits as separate tensors, for the output and the state."""
    H, K = 3, 8
    gen = torch.Generator().manual_seed(batch)
    qkv = torch.randn(batch, 3, H, K, generator=gen)
    g = -torch.rand(batch, H, K, generator=gen)
    beta = torch.rand(batch, H, generator=gen)
    pool = torch.randn(batch + 2, H, K, K, generator=gen)
    slots = torch.arange(batch).flip(0) + 1  # not in order: the copy-and-write-back path for batch > 1
    outs = []
    for q, k, v in (qkv.unbind(1), [t.clone() for t in qkv.unbind(1)]):
        state = pool.clone()
        outs.append((kda_recurrent_step(q, k, v, g, beta, state, slots, scale=0.3, use_qk_l2norm=True), state))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    q, k, v = (t.clone() for t in qkv.unbind(1))
    ref_o, ref_state = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=pool[slots],
                                           cu_seqlens=torch.arange(batch + 1), use_qk_l2norm=True)
    assert_close("o vs naive", ref_o, outs[0][0], 1e-5)
    assert_close("state vs naive", ref_state, outs[0][1][slots], 1e-5)
