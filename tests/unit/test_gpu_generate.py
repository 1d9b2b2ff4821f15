"""``helixserve generate`` on the GPU against the CPU.

- Tiny presets in fp32: the same greedy tokens as on the CPU (CLI), also for a batch of prompts
  through the LLM API, and CUDA-graph decode == eager decode on the GPU.
- ``kimi-k3-mid``: greedy generation runs on the GPU in bf16 (CLI and a batch); prefill logits in
  fp32 on the GPU equal the CPU's (2e-3 relative RMS), and in bf16 they are no further from the
  CPU's fp32 logits than 1.5x the CPU's own bf16 model is (see the test for why not a fixed bound).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # fp32 dots in fla exact, like the reference

from helixserve.cli import main as cli_main  # noqa: E402
from helixserve.config import CacheConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch  # noqa: E402
from helixserve.models.loading import load_model  # noqa: E402
from helixserve.models.presets import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 77)), [(7 * i) % 250 for i in range(130)], [33]]


def generate_cli(capsys, model_dir, prompt_ids, max_tokens, *extra) -> list[int]:
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt_ids)),
            "--max-tokens", str(max_tokens), "--ignore-eos", "--json", *extra]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_tiny_generate_cli_same_tokens_as_cpu(tiny_checkpoints, capsys, preset):
    for prompt in PROMPTS[:3]:
        cpu = generate_cli(capsys, tiny_checkpoints[preset], prompt, 24)
        gpu = generate_cli(capsys, tiny_checkpoints[preset], prompt, 24, "--device", "cuda", "--dtype", "float32")
        assert gpu == cpu, f"{preset} prompt of {len(prompt)}"


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_tiny_batched_gpu_graphs_eager_and_cpu_agree(tiny_checkpoints, preset):
    """Several prompts at once (varlen prefill, padded graph batches, chunked prefill at 64 tokens)."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)  # greedy: CPU and CUDA RNGs differ
    cache = CacheConfig(max_num_seqs=6)
    from helixserve.config import SchedulerConfig

    sched = SchedulerConfig(max_num_batched_tokens=64)
    results = {}
    for name, device in (("cpu", "cpu"), ("graphs", "cuda"), ("eager", "cuda")):
        llm = LLM(tiny_checkpoints[preset], dtype="float32", device=device, cache=cache, scheduler=sched)
        if name == "eager":
            llm.engine.runner.decode_graphs = None
        elif name == "graphs":
            assert llm.engine.runner.decode_graphs is not None
        results[name] = [r.token_ids for r in llm.generate(PROMPTS, params)]
    assert results["graphs"] == results["eager"] == results["cpu"]


@pytest.fixture(scope="module")
def mid_checkpoint(tmp_path_factory):
    """``HELIXSERVE_TEST_MID_CKPT`` may name one already written (``make-checkpoint --preset kimi-k3-mid``)."""
    existing = os.environ.get("HELIXSERVE_TEST_MID_CKPT")
    if existing:
        return existing
    return make_checkpoint("kimi-k3-mid", tmp_path_factory.mktemp("mid") / "kimi-k3-mid", seed=0, dtype="bfloat16")


def all_logits(model, token_ids: list[int], device: str) -> torch.Tensor:
    """Logits of every row of one prefill of ``token_ids`` (fresh caches)."""
    cfg, tpb = model.cfg, 16
    blocks = -(-len(token_ids) // tpb)
    caches = allocate_caches(cfg, blocks, tpb, 1, dtype=model.dtype, device=device)
    with torch.inference_mode():
        return model(build_batch([SeqChunk(token_ids, 0, 0)], tpb, blocks, device=device), caches).float().cpu()


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt()).item()


def test_mid_size_gpu_within_tolerance_of_cpu(mid_checkpoint, capsys):
    """fp32 on the GPU == the CPU (the fast kernels are exact); bf16 on the GPU is no less accurate
    against CPU fp32 than the CPU's own bf16 model. The random-weight K3 model is chaotic in bf16
    (top-k routing over near-tied expert scores flips under rounding): on the CPU alone its bf16
    prefill logits part from fp32 by 0.47-0.80 relative RMS for multi-token prompts, so a fixed
    bf16 bound would test the model's sensitivity, not the GPU path. Measured on one H200:
    fp32 4.5e-5 / 2.7e-5 / 3.9e-4 / 1.6e-6; bf16 0.62 / 0.51 / 0.74 / 0.0077 against
    the CPU bf16's 0.54 / 0.47 / 0.80 / 0.0073."""
    max_tokens = 16
    cli_tokens = generate_cli(capsys, mid_checkpoint, PROMPTS[1], max_tokens, "--device", "cuda")
    llm = LLM(mid_checkpoint, device="cuda", cache=CacheConfig(max_num_seqs=4, memory_budget_mib=512))
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    batch_tokens = [r.token_ids for r in llm.generate(PROMPTS, greedy)]
    assert len(cli_tokens) == max_tokens and all(len(t) == max_tokens for t in batch_tokens)
    del llm

    cpu_fp32 = load_model(mid_checkpoint, dtype=torch.float32, device="cpu")
    cpu_bf16 = load_model(mid_checkpoint, dtype=torch.bfloat16, device="cpu")
    want = [all_logits(cpu_fp32, p, "cpu") for p in PROMPTS]
    cpu_err = [rel_rms(all_logits(cpu_bf16, p, "cpu"), w) for p, w in zip(PROMPTS, want, strict=True)]
    del cpu_bf16
    for dtype in (torch.float32, torch.bfloat16):
        gpu_model = load_model(mid_checkpoint, dtype=dtype, device="cuda")
        for prompt, ref, bf16_err in zip(PROMPTS, want, cpu_err, strict=True):
            err = rel_rms(all_logits(gpu_model, prompt, "cuda"), ref)
            bound = 2e-3 if dtype == torch.float32 else 1.5 * bf16_err + 1e-2
            assert err <= bound, f"{dtype} prompt of {len(prompt)}: rel-rms {err:.3e} > {bound:.3e}"
        del gpu_model
