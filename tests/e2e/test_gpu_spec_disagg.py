"""Speculative decoding served on one GPU: a disaggregated request (router -> ctx prefill -> CUDA
IPC -> a gen world of one with ``gen[].speculative: ngram``) beside the aggregated single-process
gen worker with the same ``speculative``; both replay their verify steps as CUDA graphs. fp32,
greedy, a prompt that prompt lookup drafts from every step. GPU-marked (skipped without CUDA).

The disaggregated answer is the aggregated one, and its gen world drafts and accepts exactly the
drafts the aggregated worker does (their ``/metrics`` counters move alike)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import Deployment
from tests.e2e.test_spec_serving import SPEC, serve_both

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"gen": {"speculative": SPEC, "cp": 1}, "baseline_gen": {"speculative": SPEC},
            "model": {"device": "cuda:0", "dtype": "float32"}}


def test_gpu_disaggregated_speculation_equals_aggregated(dep: Deployment) -> None:
    served = serve_both(dep)
    world, single = served["world"], served["single"]
    assert served["disaggregated"] == served["aggregated"]
    assert world == single, (world, single)
    assert world["num_draft_tokens"] > world["num_accepted_tokens"] > 0, world
    assert dep.is_idle()
