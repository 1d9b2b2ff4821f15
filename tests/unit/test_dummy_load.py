"""``load_format: dummy``: seeded random weights at a preset's (or a checkpoint config's) real
shapes, no weight file read, through ``LLM``, the CLI, a worker's loader and a dp x cp world."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helixserve.cli import main as cli_main
from helixserve.config import DeploymentConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.launch.offline import generate_on_world
from helixserve.models.loading import load_model, model_tensors
from helixserve.models.dummy import load_dummy_model, model_config_of
from helixserve.models.presets import get_preset
from helixserve.serving.loading import load_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [72, 101, 108, 108, 111, 33]


def tokens(llm: LLM, prompt=PROMPT) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_dummy_model_has_the_checkpoint_models_tensors(tiny_checkpoints, preset):
    loaded = model_tensors(load_model(tiny_checkpoints[preset]))
    dummy = model_tensors(load_dummy_model(get_preset(preset)))
    assert {n: (tuple(t.shape), t.dtype, t.stride()) for n, t in dummy.items()} == \
        {n: (tuple(t.shape), t.dtype, t.stride()) for n, t in loaded.items()}
    for name, t in dummy.items():
        assert torch.isfinite(t).all(), name
        if t.dim() == 2 and "embed" not in name and not name.endswith("_res_proj.weight"):
            std = t.float().std().item()  # N(0, 1/fan_in), whichever dim the packed layout stores first
            assert any(0.7 < std * fan_in ** 0.5 < 1.4 for fan_in in t.shape), (name, std)


def test_dummy_generation_is_seeded_and_serves_text():
    a = LLM("kimi-k3-tiny", load_format="dummy", seed=3)
    again = LLM("kimi-k3-tiny", load_format="dummy", seed=3)
    other = LLM("kimi-k3-tiny", load_format="dummy", seed=4)
    assert tokens(a) == tokens(again)
    assert tokens(a) != tokens(other)
    out = a.generate(["hello"], GREEDY)[0]
    assert out.prompt_token_ids == list(b"hello") and len(out.token_ids) == GREEDY.max_tokens
    assert a.tokenizer.decode(list(b"hello")) == "hello"


def test_dummy_reads_a_checkpoint_dirs_config_and_no_weight_file(tiny_checkpoints, tmp_path):
    only_config = tmp_path / "cfg-only"
    only_config.mkdir()
    shutil.copy(tiny_checkpoints["kimi-linear-tiny"] / "config.json", only_config / "config.json")
    assert model_config_of(only_config, "dummy") == model_config_of(tiny_checkpoints["kimi-linear-tiny"])
    assert tokens(LLM(only_config, load_format="dummy")) == tokens(LLM("kimi-linear-tiny", load_format="dummy"))
    absolute = tmp_path / "not-made" / "kimi-linear-tiny"  # a launcher's absolute path of a preset name
    assert model_config_of(absolute, "dummy") == get_preset("kimi-linear-tiny")


def test_dummy_bad_names_and_formats():
    with pytest.raises(ValueError, match="neither a checkpoint directory.*presets"):
        LLM("no-such-model", load_format="dummy")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM("kimi-linear-tiny")  # a preset name is not a checkpoint without dummy
    with pytest.raises(ValueError, match="unknown load_format 'safetensors'"):
        LLM("kimi-linear-tiny", load_format="safetensors")
    with pytest.raises(ValueError, match="load_format"):
        DeploymentConfig.model_validate({"model": {"path": "kimi-linear-tiny", "load_format": "pt"}})


def test_dummy_mxfp4_stacks_hold_fp4_bytes_at_the_init_scale():
    cfg = get_preset("kimi-k3-tiny")
    model = load_dummy_model(cfg, experts="packed")
    experts = model.model.layers[1].ffn.experts
    assert experts.is_mxfp4 and experts.w13_packed.dtype == torch.uint8
    w13, _ = experts.stacks()
    std = w13.dequantize(torch.float32).std().item() * cfg.expert_dim ** 0.5
    assert 0.5 < std < 2
    logits = LLM("kimi-k3-tiny", load_format="dummy", experts="packed").generate([PROMPT], GREEDY)
    assert len(logits[0].token_ids) == GREEDY.max_tokens


def test_cli_generate_dummy_equals_the_api(capsys):
    argv = ["generate", "--model", "kimi-linear-tiny", "--load-format", "dummy", "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-tokens", "8", "--ignore-eos", "--json", "--enforce-eager"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == tokens(LLM("kimi-linear-tiny", load_format="dummy"))
    assert cli_main(["generate", "--model", "kimi-linear-tiny", "--prompt-ids", "1"]) == 2  # no dummy: no dir
    assert "no config.json" in capsys.readouterr().err


def test_worker_loader_takes_the_config_keys():
    deploy = DeploymentConfig.model_validate(
        {"model": {"path": "kimi-k3-tiny", "load_format": "dummy", "enforce_eager": True}})
    driver, tokenizer, cfg = load_engine(deploy)
    assert cfg == get_preset("kimi-k3-tiny") and tokenizer is not None
    assert driver.core.runner.decode_graphs is None
    assert deploy.model.name == "kimi-k3-tiny"


def test_a_dummy_world_holds_the_single_process_weights():
    """A cp=2 world draws each full tensor and keeps its slices: the single process's tokens."""
    world = generate_on_world("kimi-linear-tiny", None, PROMPT, GREEDY, dp=1, cp=2, load_format="dummy")
    assert world.token_ids == tokens(LLM("kimi-linear-tiny", load_format="dummy"))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kimi-k3-mid", "kimi-linear-48b"])
def test_gpu_dummy_real_size_generates_in_bf16(preset):
    """Real-size presets with dummy weights on one GPU (kimi-linear-48b: ~96 GB of bf16 weights):
    built on the device, decode in CUDA graphs, finite logits, the same tokens twice."""
    from helixserve.config import CacheConfig

    llm = LLM(preset, load_format="dummy", device="cuda", cache=CacheConfig(memory_budget_mib=4096, max_num_seqs=8))
    assert llm.engine.runner.decode_graphs is not None
    assert next(llm.engine.runner.model.parameters()).device.type == "cuda"
    first = llm.generate(["The quick brown fox", PROMPT], GREEDY)
    assert all(len(r.token_ids) == GREEDY.max_tokens for r in first)
    assert [r.token_ids for r in llm.generate(["The quick brown fox", PROMPT], GREEDY)] == [r.token_ids for r in first]
