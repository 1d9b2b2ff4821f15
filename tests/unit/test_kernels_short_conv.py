"""Causal short convolution: varlen/stateful prefill, decode step, transformers' torch conv."""

from __future__ import annotations

import pytest
import torch

from helixserve.kernels import short_conv_prefill, short_conv_step
from helixserve.kernels.short_conv.naive import naive_short_conv
from tests._testing import assert_close

D, W = 6, 4


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_prefill_with_state_matches_naive(activation):
    # sequence lengths 0, 1, 2 (< W-1), 3, 9
    cu = torch.tensor([0, 0, 1, 3, 6, 15])
    x, weight = rand(15, D, seed=0), rand(D, W, seed=1)
    state = rand(5, D, W - 1, seed=2)
    y, new_state = short_conv_prefill(x, weight, conv_state=state, cu_seqlens=cu, activation=activation)
    y_ref, state_ref = naive_short_conv(x, weight, state, cu, activation)
    assert_close("y", y_ref, y, 1e-6)
    assert_close("state", state_ref, new_state, 1e-6)
    # a 1-token sequence keeps its 2 newest old columns, then the new input
    assert torch.equal(new_state[1, :, :2], state[1, :, 1:])
    assert torch.equal(new_state[1, :, 2], x[0])
    assert torch.equal(new_state[0], state[0]), "an empty sequence keeps its state"


def test_split_prefill_with_carried_state_equals_one_prefill():
    x, weight = rand(23, D, seed=3), rand(D, 1, W, seed=4)  # checkpoint layout [D, 1, W]
    y_full, state_full = short_conv_prefill(x, weight)
    state, pieces = None, []
    for s, e in [(0, 1), (1, 3), (3, 10), (10, 11), (11, 23)]:
        y, state = short_conv_prefill(x[s:e], weight, conv_state=state)
        pieces.append(y)
    assert_close("y", y_full, torch.cat(pieces), 1e-6)
    assert_close("state", state_full, state, 1e-6)


def test_steps_equal_prefill():
    x, weight = rand(12, D, seed=5), rand(D, W, seed=6)
    init = rand(1, D, W - 1, seed=7)
    y_full, state_full = short_conv_prefill(x, weight, conv_state=init)
    pool = torch.full((3, D, W - 1), float("nan"))
    pool[1] = init[0]
    slot = torch.tensor([1])
    ys = [short_conv_step(x[t:t + 1], weight, pool, slot) for t in range(12)]
    assert_close("y", y_full, torch.cat(ys), 1e-6)
    assert_close("state", state_full[0], pool[1], 1e-6)
    assert torch.isnan(pool[[0, 2]]).all()


def test_batched_step_scattered_slots():
    x, weight = rand(3, D, seed=8), rand(D, W, seed=9)
    pool = rand(5, D, W - 1, seed=10)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    y = short_conv_step(x, weight, pool, slots, activation=None)
    y_ref, state_ref = naive_short_conv(x, weight, before[slots], torch.arange(4), None)
    assert_close("y", y_ref, y, 1e-6)
    assert_close("state", state_ref, pool[slots], 1e-6)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_matches_transformers_causal_conv1d():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x, weight = rand(10, D, seed=11), rand(D, W, seed=12)
    ref = modeling.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    y, _ = short_conv_prefill(x, weight)
    assert_close("prefill", ref, y, 1e-6)
    hf_state = rand(1, D, W - 1, seed=13)
    state = hf_state.clone()
    ref_step = modeling.causal_conv1d_update(x[:1].t()[None], hf_state, weight, activation="silu")[0].t()
    y_step = short_conv_step(x[:1], weight, state, torch.tensor([0]))
    assert_close("step", ref_step, y_step, 1e-6)
    assert_close("step state", hf_state, state, 1e-6)


def test_bf16_state_keeps_dtype():
    x, weight = rand(7, D, seed=14, dtype=torch.bfloat16), rand(D, W, seed=15, dtype=torch.bfloat16)
    state = rand(1, D, W - 1, seed=16, dtype=torch.bfloat16)
    y, new_state = short_conv_prefill(x, weight, conv_state=state)
    y_ref, state_ref = naive_short_conv(x, weight, state)
    assert y.dtype == torch.bfloat16 and new_state.dtype == torch.bfloat16
    assert_close("y", y_ref, y.float(), 5e-3)
    assert torch.equal(state_ref.bfloat16(), new_state)


def test_prefill_reads_only_its_rows():
    T = 9
    x, weight = rand(T, D, seed=17), rand(D, W, seed=18)
    buf = torch.full((T + 4, D), float("nan"))
    buf[2:T + 2] = x
    y, state = short_conv_prefill(buf[2:T + 2], weight)
    y_ref, state_ref = naive_short_conv(x, weight)
    assert_close("y", y_ref, y, 1e-6)
    assert_close("state", state_ref, state, 1e-6)


def test_rejects_bad_arguments():
    x, weight = rand(5, D, seed=0), rand(D, W, seed=1)
    with pytest.raises(ValueError, match="weight must be"):
        short_conv_prefill(x, rand(D + 1, W, seed=0))
    with pytest.raises(ValueError, match="weight must be"):
        short_conv_prefill(x, rand(D, 2, W, seed=0))
    with pytest.raises(ValueError, match="conv_state must have shape"):
        short_conv_prefill(x, weight, conv_state=torch.zeros(1, D, W))
    with pytest.raises(ValueError, match="conv_state must have shape"):
        short_conv_prefill(x, weight, conv_state=torch.zeros(1, D, W - 1), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="activation"):
        short_conv_prefill(x, weight, activation="gelu")
    with pytest.raises(ValueError, match="x must be 2-D"):
        short_conv_prefill(x[None], weight)
    pool = torch.zeros(2, D, W - 1)
    with pytest.raises(ValueError, match="conv_pool must be"):
        short_conv_step(x[:1], weight, torch.zeros(2, D, W), torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_ids must lie"):
        short_conv_step(x[:1], weight, pool, torch.tensor([2]))
    with pytest.raises(ValueError, match="slot_ids must have shape"):
        short_conv_step(x[:2], weight, pool, torch.tensor([0]))
