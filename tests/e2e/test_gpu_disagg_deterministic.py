"""``model.deterministic: true`` on one GPU in bf16: disaggregated == aggregated through the
servers (the ctx's chunked prefill and the gen's own prefill of the same prompt give the same
tokens, and so does each request whatever it is batched with: batch-invariant GEMMs and fixed
reduction orders). The ctx and a gen world of one share ``cuda:0``; the KV is pulled over CUDA
IPC. GPU-marked (skipped without CUDA)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helixserve.testing.servers import http
from tests.e2e.conftest import MODEL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGET = 32
PROMPT_LENS = [1, 4, 5, BUDGET, BUDGET + 1, 3 * BUDGET + 7]


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"baseline_gen": True, "scheduler": {"max_num_batched_tokens": BUDGET},
            "model": {"device": "cuda:0", "dtype": "bfloat16", "deterministic": True}, "gen": {"cp": 1}}


def _complete(url: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    status, reply = http("POST", f"{url}/v1/completions", body, timeout=120)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 16, reply
    return reply["choices"][0]["text"]


def test_gpu_deterministic_disaggregated_equals_aggregated_bf16(dep):
    prompts = [[(11 * i + n) % 250 + 1 for i in range(n)] for n in PROMPT_LENS]
    alone = [_complete(dep.baseline_url, p) for p in prompts]  # aggregated, one request at a time
    with ThreadPoolExecutor(len(prompts)) as pool:  # disaggregated, all at once (batched together)
        together = list(pool.map(lambda p: _complete(dep.router_url, p), prompts))
    for n, got, want in zip(PROMPT_LENS, together, alone):
        assert got == want, f"prompt of {n} tokens"
    assert dep.is_idle()
