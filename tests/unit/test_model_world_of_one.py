"""The one model forward at a world of one (dp 1 x cp 1) is the single-process model.

- its logits and caches are bit-for-bit those of a reference written here step by step from the
  plain layer modules (mixer, FFN, norms, AttnRes mix), for both tiny presets, plain and packed
  weights, fp32 and bf16, through prefill, prompt continuation, decode and a no-logits chunk;
- it has the single-process parameter names and shapes (MLA keeps ``kv_b_proj``), and the sharded
  loader at a world of one gives the packed single-process model with bit-equal logits;
- it runs no helix hook (each hook replaced by one that raises still lets it run); a phase timer
  runs the hooks and changes no bit;
- a rank of a larger world refuses to run unbound, with zero tokens, or with a bad ``moe_mode``.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from helixserve import kernels
from helixserve.cache_layout import cache_spec_for
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.loading import load_model
from helixserve.cache_layout import ModelCaches
from helixserve.models.context import ForwardBatch
from helixserve.models.helix_hooks import PhaseTimer
from helixserve.models.helix_load import load_helix_model
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.packing import pack_for_cpu
from helixserve.models.presets import get_preset, init_random_weights
from helixserve.parallel import Mapping, ParallelGroups

PRESETS = ["kimi-linear-tiny", "kimi-k3-tiny"]
TPB, BLOCKS_PER_SEQ, NUM_SLOTS = 4, 12, 4
ONE = Mapping(1, 0, dp=1, cp=1)


def _mix(norm, proj, prefix: torch.Tensor, snapshots: list[torch.Tensor]) -> torch.Tensor:
    if not snapshots:
        return prefix
    return kernels.attn_res_mix(prefix, torch.stack(snapshots), norm.weight, proj.weight, norm.eps)


def reference_logits(model: KimiForCausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
    """The Kimi forward spelled out over the plain layer modules (see :mod:`helixserve.models.kimi`)."""
    cfg, m = model.cfg, model.model
    h = m.embed_tokens(batch.input_ids)
    block = cfg.attn_res_block_size
    snapshots: list[torch.Tensor] = []
    for i, layer in enumerate(m.layers):
        ffn = layer.block_sparse_moe if cfg.is_moe_layer(i) else layer.mlp
        if block is None:
            h = h + layer.self_attn(layer.input_layernorm(h), batch, caches)
            h = h + ffn(layer.post_attention_layernorm(h))
            continue
        prefix = h
        x = _mix(layer.self_attention_res_norm, layer.self_attention_res_proj, prefix, snapshots)
        if i % block == 0:
            snapshots.append(prefix)
            prefix = None
        a = layer.self_attn(layer.input_layernorm(x), batch, caches)
        prefix = a if prefix is None else prefix + a
        x = _mix(layer.mlp_res_norm, layer.mlp_res_proj, prefix, snapshots)
        h = prefix + ffn(layer.post_attention_layernorm(x))
    if block is not None:
        h = _mix(m.output_attn_res_norm, m.output_attn_res_proj, h, snapshots)
    h = m.norm(h)
    if batch.wants_no_logits:
        return h.new_zeros(0, cfg.vocab_size, dtype=torch.float32)
    if batch.logits_indices is not None:
        h = h[batch.logits_indices]
    return model.lm_head(h).float()


def _batches() -> list[ForwardBatch]:
    """Prefill of two prompts (one crossing blocks), a prompt chunk without logits, mixed
    prefill + decode, decodes (flagged and derived), a continuation chunk."""
    gen = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, 256, (n,), generator=gen).tolist()
    steps = [
        ([SeqChunk(ids(13), 0, 0), SeqChunk(ids(3), 0, 1)], True, None),
        ([SeqChunk(ids(6), 0, 2)], False, "no_logits"),
        ([SeqChunk([5], 13, 0), SeqChunk(ids(5), 6, 2), SeqChunk([9], 3, 1)], False, None),
        ([SeqChunk([4], 14, 0), SeqChunk([8], 4, 1), SeqChunk([2], 11, 2)], True, "decode"),
        ([SeqChunk([3], 15, 0), SeqChunk([1], 5, 1)], False, None),
        ([SeqChunk(ids(4), 16, 0)], True, None),
    ]
    out = []
    for chunks, last_only, kind in steps:
        batch = build_batch(chunks, TPB, BLOCKS_PER_SEQ, last_token_logits_only=last_only)
        if kind == "no_logits":
            batch.logits_indices = torch.zeros(0, dtype=torch.int64)
        elif kind == "decode":
            batch.is_decode = True
        out.append(batch)
    return out


def _caches(model: KimiForCausalLM) -> ModelCaches:
    return allocate_caches(model.cfg, NUM_SLOTS * BLOCKS_PER_SEQ, TPB, NUM_SLOTS, dtype=model.dtype)


def _model(preset: str, dtype: torch.dtype, packed: bool) -> KimiForCausalLM:
    model = KimiForCausalLM(get_preset(preset), dtype=torch.float32).eval().requires_grad_(False)
    init_random_weights(model, seed=3)
    model = model.to(dtype)
    return pack_for_cpu(model) if packed else model


def _same_caches(a: ModelCaches, b: ModelCaches) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in ((a.mla_kv, b.mla_kv), (a.kda_state, b.kda_state),
                                                   (a.conv_state, b.conv_state)) for k in x)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
@torch.no_grad()
def test_world_of_one_equals_the_step_by_step_reference(preset: str, dtype: torch.dtype, packed: bool) -> None:
    model = _model(preset, dtype, packed)
    assert model.mapping == ONE
    got_caches, want_caches = _caches(model), _caches(model)
    for step, batch in enumerate(_batches()):
        got, want = model(batch, got_caches), reference_logits(model, batch, want_caches)
        assert got.dtype == torch.float32 and got.shape == want.shape, step
        assert torch.equal(got, want), f"step {step}: logits differ by {(got - want).abs().max().item():.3e}"
    assert _same_caches(got_caches, want_caches)


@pytest.mark.parametrize("preset", PRESETS)
def test_world_of_one_is_the_single_process_model(tiny_checkpoints, preset: str) -> None:
    cfg = get_preset(preset)
    plain, world = KimiForCausalLM(cfg), KimiForCausalLM(cfg, mapping=ONE)
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes(world) == shapes(plain)
    assert any(n.endswith("self_attn.kv_b_proj.weight") for n in shapes(world))
    single = load_model(tiny_checkpoints[preset])
    sharded = load_helix_model(tiny_checkpoints[preset], ONE)
    want_state, got_state = single.state_dict(), sharded.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[n], t) for n, t in want_state.items())
    assert all(layer.self_attn.in_proj is not None for layer in sharded.model.layers)  # packed on CPU
    got_caches, want_caches = _caches(sharded), _caches(single)
    with torch.no_grad():
        for step, batch in enumerate(_batches()):
            assert torch.equal(sharded(batch, got_caches), single(batch, want_caches)), step


def _refuse(*args, **kwargs):
    raise AssertionError("a world of one ran a helix hook")


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_world_of_one_runs_no_hook_and_a_timer_changes_no_bit(preset: str) -> None:
    model = _model(preset, torch.float32, packed=True)
    quiet, timed = _caches(model), _caches(model)
    batches = _batches()
    hooks = model.helix
    real = {name: getattr(hooks, name) for name in ("mixer", "ffn", "gather", "scatter", "slice_rows", "_routed_experts")}
    for name in real:
        setattr(hooks, name, _refuse)
    plain = [model(b, quiet) for b in batches]
    model.empty_step()  # nothing to join at a world of one
    for name, fn in real.items():
        setattr(hooks, name, fn)
    model.timer = PhaseTimer(torch.device("cpu"))
    for step, batch in enumerate(batches):
        assert torch.equal(model(batch, timed), plain[step]), step
    assert {"kda", "mla_attend", "moe_local", "residual", "lm_head"} <= set(model.timer.seconds)
    assert _same_caches(quiet, timed)


def test_a_rank_of_a_larger_world_refuses_bad_use() -> None:
    cfg = get_preset("kimi-k3-tiny")
    mapping = Mapping(2, 1, dp=1, cp=2)
    model = KimiForCausalLM(cfg, mapping=mapping).eval().requires_grad_(False)
    init_random_weights(model, seed=0)
    assert model.kda_num_local_heads == cfg.kda_num_heads // 2
    spec = cache_spec_for(cfg, model.dtype, TPB, kda_num_heads=model.kda_num_local_heads)
    caches = allocate_model_caches(spec, 8, 2, torch.device("cpu"))
    batch = build_batch([SeqChunk([1, 2, 3], 0, 0)], TPB, 2)
    with pytest.raises(RuntimeError, match=r"bind\(groups\) was not called"):
        model(batch, caches)
    empty = build_batch([], TPB, 2)
    with pytest.raises(ValueError, match="call empty_step"):
        model(empty, caches)
    with pytest.raises(ValueError, match="moe_mode must be 'sliced' or 'replicated', got 'both'"):
        model.moe_mode = "both"
    with pytest.raises(ValueError, match="moe_mode must be"):
        KimiForCausalLM(cfg, mapping=mapping, moe_mode="both")
    cpu = torch.device("cpu")
    other = ParallelGroups(Mapping(2, 0, dp=2, cp=1), "gloo", cpu, None, None, None, None, None, None, None,
                           datetime.timedelta(seconds=1))
    with pytest.raises(ValueError, match="groups are for"):
        model.bind(other)
