"""Shared fixtures: tiny preset checkpoints (targets and drafters) written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_PRESETS = ("kimi-linear-tiny", "kimi-k3-tiny")


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """``{preset: checkpoint dir}`` for both tiny presets (seed 0, float32)."""
    from helixserve.models.presets import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(name, root / name, seed=0) for name in TINY_PRESETS}


@pytest.fixture(scope="session")
def tiny_drafters(tmp_path_factory) -> dict[str, Path]:
    """``{method: checkpoint dir}``: kimi-linear-tiny's draft model (``draft``) and hidden-state
    drafter (``hidden``), seed 0, float32."""
    from helixserve.models.presets import make_checkpoint

    root = tmp_path_factory.mktemp("drafters")
    return {"draft": make_checkpoint("kimi-linear-tiny-draft", root / "draft", seed=0),
            "hidden": make_checkpoint("kimi-linear-tiny-hidden", root / "hidden", seed=0)}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
