"""Decode CUDA graphs on or off: ``model.enforce_eager`` turns them off, and a capture that fails
leaves the engine serving eagerly with one WARNING naming the reason.

On the CPU the capture is injected to fail where the runner calls it (no CUDA exists here); the
GPU tests make a real capture fail (a host read inside the captured forward) and serve fp32
``kimi-k3-mid``, whose MoE runs the static every-expert form under capture.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helixserve.config import CacheConfig, DeploymentConfig
from helixserve.engine import runner as runner_module
from helixserve.engine.llm import LLM
from helixserve.engine.rank_setup import decode_graphs_off_reason
from helixserve.engine.request import SamplingParams

PROMPTS = [[5, 6, 7], list(range(20, 57))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class _CaptureFails:
    """Stands in for DecodeGraphs: construction succeeds, capture raises what CUDA raises for a
    sync inside a capture."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def capture(self) -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")


def test_failed_capture_leaves_decode_eager_with_one_warning(tiny_checkpoints, monkeypatch, caplog):
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(max_num_seqs=4))
    want = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(runner_module, "DecodeGraphs", _CaptureFails)
    with caplog.at_level(logging.WARNING, logger="helixserve.engine.runner"):
        reason = llm.engine.runner.capture_decode_graphs(4, 8, llm.engine.layout.num_slots)
    assert reason == "capture failed: RuntimeError: CUDA error: operation not permitted when stream is capturing"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    assert llm.engine.runner.decode_graphs is None
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want


def test_an_error_that_is_not_a_runtime_error_still_propagates(tiny_checkpoints, monkeypatch):
    """Only capture failures (RuntimeError and its CUDA subclasses) fall back; a bug does not hide."""
    llm = LLM(tiny_checkpoints["kimi-linear-tiny"], cache=CacheConfig(max_num_seqs=4))

    class _Bug(_CaptureFails):
        def capture(self) -> None:
            raise TypeError("a bug in the capture code")

    monkeypatch.setattr(runner_module, "DecodeGraphs", _Bug)
    with pytest.raises(TypeError, match="a bug"):
        llm.engine.runner.capture_decode_graphs(4, 8, llm.engine.layout.num_slots)


def test_enforce_eager_is_the_reason_graphs_are_off(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["kimi-linear-tiny"], enforce_eager=True)
    assert decode_graphs_off_reason(llm.engine.runner.model, "cuda", False, 1) == "enforce_eager"
    assert llm.engine.runner.decode_graphs is None


def test_model_enforce_eager_config_key(tmp_path):
    deploy = DeploymentConfig.model_validate({"model": {"path": str(tmp_path), "enforce_eager": True}})
    assert deploy.model.enforce_eager
    assert not DeploymentConfig.model_validate({"model": {"path": str(tmp_path)}}).model.enforce_eager
    with pytest.raises(ValueError, match="enforce_eager"):
        DeploymentConfig.model_validate({"model": {"path": str(tmp_path), "enforce_eager": "sometimes"}})


# ---------------------------------------------------------------- GPU


class _HostReadInCapture(torch.nn.Module):
    """The model, plus a host read when a stream captures: a real capture failure."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, batch, caches):
        logits = self.inner(batch, caches)
        if torch.cuda.is_current_stream_capturing():
            logits.sum().item()
        return logits


@pytest.mark.gpu
def test_gpu_real_capture_failure_serves_eagerly(tiny_checkpoints, caplog):
    cache = CacheConfig(max_num_seqs=4)
    eager = LLM(tiny_checkpoints["kimi-k3-tiny"], dtype="float32", device="cuda", cache=cache, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    want = [r.token_ids for r in eager.generate(PROMPTS, GREEDY)]
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], dtype="float32", device="cuda", cache=cache, enforce_eager=True)
    runner = llm.engine.runner
    runner.model = _HostReadInCapture(runner.model)
    with caplog.at_level(logging.WARNING, logger="helixserve.engine.runner"):
        reason = runner.capture_decode_graphs(4, 8, llm.engine.layout.num_slots)
    assert reason is not None and reason.startswith("capture failed:")
    assert runner.decode_graphs is None
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want


@pytest.mark.gpu
def test_gpu_fp32_mid_captures_and_matches_eager(tmp_path_factory):
    """fp32 ``kimi-k3-mid`` on CUDA: the decode graphs capture (the MoE takes the static
    every-expert form past the gathered form's bound) and give the eager tokens."""
    from helixserve.models.presets import make_checkpoint

    ckpt = make_checkpoint("kimi-k3-mid", tmp_path_factory.mktemp("mid32") / "kimi-k3-mid", seed=0)
    cache = CacheConfig(max_num_seqs=32, memory_budget_mib=2048)
    graphs = LLM(ckpt, dtype="float32", device="cuda", cache=cache)
    assert graphs.engine.runner.decode_graphs is not None
    eager = LLM(ckpt, dtype="float32", device="cuda", cache=cache, enforce_eager=True)
    for prompt in PROMPTS:
        assert (graphs.generate([prompt], GREEDY)[0].token_ids == eager.generate([prompt], GREEDY)[0].token_ids)
