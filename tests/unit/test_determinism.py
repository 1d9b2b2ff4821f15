"""Reproducible greedy decoding, and the batch-invariant mode (``model.deterministic``).

By default a request's tokens are the same on every run (no atomic accumulation on the served
path: see ``test_kernels_moe.py``'s pair-sum test); with ``deterministic`` a request's tokens do
not depend on what it is batched with. The GPU tests serve ``kimi-k3-mid`` with dummy weights in
bf16 (no checkpoint to write)."""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig, DeploymentConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.kernels.triton_common import batch_invariant_enabled, set_batch_invariant

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
OTHERS = [[30 + i % 400 for i in range(n)] for n in (1, 7, 64, 200, 513)]  # ids < every preset's vocab
# lengths around a 64-token page and a long one: on the GPU these diverged run to run while the
# MoE summed expert rows with atomic adds
REPEAT_LENGTHS = (5, 63, 64, 65, 300, 1000)


@pytest.fixture
def restore_flags():
    yield
    set_batch_invariant(False)


def test_batch_invariant_mode_sets_the_torch_flags(restore_flags):
    set_batch_invariant(True)
    assert batch_invariant_enabled() and torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    set_batch_invariant(False)
    assert not batch_invariant_enabled() and not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


def test_model_deterministic_reaches_the_kernels(restore_flags):
    from helixserve.serving.loading import load_engine

    deploy = DeploymentConfig.model_validate(
        {"model": {"path": "kimi-linear-tiny", "load_format": "dummy", "deterministic": True}})
    driver, _, _ = load_engine(deploy)
    assert batch_invariant_enabled()
    # the served engine's prefill chunks are cut at multiples of budget - max_num_seqs decode rows
    budget, seqs = deploy.scheduler.max_num_batched_tokens, deploy.cache.max_num_seqs
    assert driver.core.scheduler.chunk_unit == budget - seqs
    set_batch_invariant(False)  # the mode is process-wide once set (LLM's docstring)
    plain, _, _ = load_engine(DeploymentConfig.model_validate(
        {"model": {"path": "kimi-linear-tiny", "load_format": "dummy", "deterministic": False}}))
    assert plain.core.scheduler.chunk_unit is None


def test_cpu_deterministic_batched_equals_alone(restore_flags):
    llm = LLM("kimi-k3-tiny", load_format="dummy", deterministic=True, cache=CacheConfig(max_num_seqs=8))
    alone = llm.generate([PROMPT], GREEDY)[0].token_ids
    batched = llm.generate([*OTHERS[:3], PROMPT], GREEDY)[-1].token_ids
    assert batched == alone


@pytest.mark.gpu
def test_gpu_greedy_alone_repeats_equal_bf16_mid():
    """The same request alone, ten times in one process (bf16, CUDA graphs), for prompts around a
    page boundary and a long one: the same tokens."""
    llm = LLM("kimi-k3-mid", load_format="dummy", device="cuda", cache=CacheConfig(memory_budget_mib=2048))
    assert llm.engine.runner.decode_graphs is not None
    for n in REPEAT_LENGTHS:
        prompt = [(7 * i + 3) % 500 for i in range(n)]
        runs = [llm.generate([prompt], GREEDY)[0].token_ids for _ in range(10)]
        assert all(r == runs[0] for r in runs), (n, runs)


@pytest.mark.gpu
def test_gpu_deterministic_batched_equals_alone_bf16_mid(restore_flags):
    """``model.deterministic``: the request batched with prompts of other lengths (prefill chunks and
    decode graphs of other sizes) gives its tokens alone."""
    llm = LLM("kimi-k3-mid", load_format="dummy", device="cuda", deterministic=True,
              cache=CacheConfig(memory_budget_mib=2048, max_num_seqs=8))
    alone = llm.generate([PROMPT], GREEDY)[0].token_ids
    for others in (OTHERS[:1], OTHERS[:3], OTHERS):
        assert llm.generate([*others, PROMPT], GREEDY)[-1].token_ids == alone, len(others)
