"""Disaggregated == aggregated on one GPU, through the servers' OpenAI API: the ctx
and a gen world of one on ``cuda:0`` (the KV pulled over CUDA IPC, as gpu1.yaml deploys), next to
a gen worker on the same GPU that prefills itself. fp32, greedy, prompts ending inside and on
4-token pages and around the 32-token prefill chunk budget. GPU-marked (skipped without CUDA).
Plain HTTP (the openai client's requests, built here): the H200 image has no ``openai`` package."""

from __future__ import annotations

import time

import pytest
import torch

from helixserve.testing.servers import http
from tests.e2e.conftest import MODEL, metric

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGET = 32
PROMPT_LENS = [1, 3, 4, 5, BUDGET - 1, BUDGET, BUDGET + 1, 2 * BUDGET + 3]


@pytest.fixture(scope="module")
def dep_options() -> dict:
    # one GPU: the gen world is a world of one
    return {"baseline_gen": True, "scheduler": {"max_num_batched_tokens": BUDGET},
            "model": {"device": "cuda:0", "dtype": "float32"}, "gen": {"cp": 1}}


def _complete(url: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    status, reply = http("POST", f"{url}/v1/completions", body, timeout=120)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 12, reply
    return reply["choices"][0]["text"]


def test_gpu_disaggregated_equals_aggregated(dep):
    before = metric(dep.gen_url, "helixserve_worker_kv_transfers_completed_total")
    granted = metric(dep.ctx_url, "helixserve_worker_kv_pickups_granted_total")
    for n in PROMPT_LENS:
        prompt = [(7 * i + n) % 250 + 1 for i in range(n)]
        got, want = _complete(dep.router_url, prompt), _complete(dep.baseline_url, prompt)
        assert got == want, f"prompt of {n} tokens"
    moved = metric(dep.gen_url, "helixserve_worker_kv_transfers_completed_total") - before
    assert moved == len(PROMPT_LENS)  # every answer decoded from the ctx's KV
    # copied on the ctx's grant (no RequestShard round trip), as the served path on one host does;
    # the ctx counts a pickup once its ack arrived (after the answer): wait for the last one, bounded
    end, seen = time.monotonic() + 10, -1.0
    while seen != len(PROMPT_LENS) and time.monotonic() < end:
        seen = metric(dep.ctx_url, "helixserve_worker_kv_pickups_granted_total") - granted
        time.sleep(0.1)
    assert seen == len(PROMPT_LENS), f"{seen} of {len(PROMPT_LENS)} pickups were copied on their grant"
    assert dep.is_idle()
