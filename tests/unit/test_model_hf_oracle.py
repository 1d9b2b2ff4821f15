"""Independent oracle: transformers' KimiLinearForCausalLM on the same weights.

A random fp32 HF model shaped like the ``kimi-linear-tiny`` preset is written with
``save_pretrained`` and loaded by helixserve; prompt logits must match and greedy generation
(our paged caches, one token per step) must produce transformers' ``generate`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helixserve.models.caches import SeqChunk, allocate_caches, build_batch, greedy_generate
from helixserve.models.loading import load_model
from helixserve.models.presets import get_preset
from helixserve.testing.hf_reference import build_hf_reference

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    out = tmp_path_factory.mktemp("hf_kimi")
    hf = build_hf_reference(get_preset("kimi-linear-tiny"), out, attn_implementation="eager")
    return hf, out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hf_config_matches_preset(hf_and_dir) -> None:
    hf, _ = hf_and_dir
    cfg = get_preset("kimi-linear-tiny")
    assert hf.config.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert hf.config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (hf.config.linear_num_heads, hf.config.linear_head_dim) == (cfg.kda_num_heads, cfg.kda_head_dim)


@pytest.mark.parametrize("prompt_len", [37, 70])  # 70 > one 64-row KDA chunk
def test_prompt_logits_match_transformers(hf_and_dir, prompt_len: int) -> None:
    hf, path = hf_and_dir
    model = load_model(path)
    prompt = _prompt(prompt_len, seed=prompt_len)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
        ours = model(build_batch([SeqChunk(prompt, 0, 1)], 16, 8), allocate_caches(model.cfg, 16, 16, 2))
    max_diff = (ref - ours).abs().max().item()
    assert max_diff < 1e-4 * max(1.0, ref.abs().max().item()), max_diff
    assert torch.equal(ref.argmax(-1), ours.argmax(-1))


def test_greedy_generation_matches_transformers(hf_and_dir) -> None:
    hf, path = hf_and_dir
    model = load_model(path)
    prompt = _prompt(29, seed=7)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
        )[0, len(prompt):].tolist()
    ours = greedy_generate(model, allocate_caches(model.cfg, 16, 16, 2), prompt, NUM_NEW_TOKENS, blocks_per_seq=8)
    assert ours == ref
    assert len(set(ours)) > 4  # not a degenerate repeat


def test_transformers_runtime_names_load(hf_and_dir, tmp_path: Path) -> None:
    """transformers' in-memory names (forget_gate.*, fused conv1d, mlp.experts.gate_up_proj) load too."""
    hf, path = hf_and_dir
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state) and any(".forget_gate." in k for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    a, b = load_model(path), load_model(tmp_path)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
