"""A hidden-state drafter served on one GPU: a disaggregated request (router -> ctx prefill, the ctx
running the drafter over the prompt -> CUDA IPC pull of the target's cache and the drafter's ->
a gen world of one with the same ``speculative``) beside the aggregated single-process gen worker.
fp32, greedy. GPU-marked (skipped without CUDA).

The disaggregated answer is the aggregated one and its gen world's ``/metrics`` counters move as
the aggregated worker's do; every worker ends idle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import Deployment
from tests.e2e.test_spec_hidden_serving import MAX_TOKENS, PROMPT, drafter_dir, hidden_options  # noqa: F401
from tests.e2e.test_spec_serving import serve_both

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def dep_options(drafter_dir: Path) -> dict:
    options = hidden_options(drafter_dir)
    options["gen"]["cp"] = 1
    return {**options, "model": {"device": "cuda:0", "dtype": "float32"}}


def test_gpu_disaggregated_hidden_speculation_drafts_as_aggregated(dep: Deployment) -> None:
    served = serve_both(dep, PROMPT, MAX_TOKENS)
    world, single = served["world"], served["single"]
    assert served["disaggregated"] == served["aggregated"]
    assert world == single, (world, single)
    assert world["num_drafts"] > 3, world
    assert dep.is_idle()
