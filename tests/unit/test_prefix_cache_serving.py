"""Prefix caching through a real ctx worker (its app served by uvicorn on loopback, the tiny K3
checkpoint): completions sharing a prefix answer the tokens of a worker with caching off, report
``usage.prompt_tokens_details.cached_tokens``, keep salts apart, and ``/metrics`` counts the
queries and hits under our names and vLLM's."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("uvicorn", reason="server deps not installed")

from helixserve.ctx_server.app import build_ctx_app  # noqa: E402
from helixserve.testing.servers import http, wait_until  # noqa: E402
from tests.unit.test_worker_warm_up import PAGE, _deploy, _serving, _status  # noqa: E402


def _completion(url: str, prompt: list[int], **extra) -> dict:
    status, answer = http("POST", f"{url}/v1/completions",
                          {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                           **extra})
    assert status == 200, answer
    return answer


def _answers(tiny_checkpoints, prefix_caching: bool, prompts: list[tuple[list[int], str | None]]) -> tuple[list, str]:
    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"], prefix_caching=prefix_caching, state_checkpoint_blocks=2)
    app = build_ctx_app(deploy, deploy.ctx[0])
    with _serving(app, deploy.ctx[0].port) as url:
        wait_until(lambda: _status(f"{url}/ready") == 200, 120, "the warm-up to finish")
        answers = [_completion(url, p, **({"cache_salt": s} if s else {})) for p, s in prompts]
        metrics = _metrics(url)
        stats = http("GET", f"{url}/stats")[1]
        assert stats["num_used_blocks"] == stats["num_held"] == 0
    return answers, metrics


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_ctx_worker_reuses_prefixes_and_answers_as_without_caching(tiny_checkpoints):
    system = list(range(30, 30 + 5 * PAGE + 1))
    prompts = [(system + [1, 2], None), (system + [3], None), (system + [3], None), (system + [3], "tenant"),
               (system[:PAGE - 1] + [9], None)]
    off, _ = _answers(tiny_checkpoints, False, prompts)
    on, metrics = _answers(tiny_checkpoints, True, prompts)
    assert [a["choices"][0]["text"] for a in on] == [a["choices"][0]["text"] for a in off]
    assert all("prompt_tokens_details" not in a["usage"] for a in off)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in on]
    # the first prompt leaves checkpoints at 8, 16 and 20 (its last full block before its last token)
    assert cached == [0, 5 * PAGE, 5 * PAGE, 0, 0]
    hits = [line for line in metrics.splitlines() if line.startswith(("vllm:prefix_cache_hits_total",
                                                                       "helixserve_worker_prefix_cache_hits_total"))]
    assert len(hits) == 2 and len({line.split()[-1] for line in hits}) == 1
    assert float(hits[0].split()[-1]) >= sum(cached)


def test_a_cache_salt_out_of_bounds_is_a_400(tiny_checkpoints):
    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"], prefix_caching=True)
    app = build_ctx_app(deploy, deploy.ctx[0])
    with _serving(app, deploy.ctx[0].port) as url:
        for salt in ("", "x" * 1025, 5):
            status, answer = http("POST", f"{url}/v1/completions",
                                  {"model": "m", "prompt": [1, 2], "max_tokens": 1, "cache_salt": salt})
            assert status == 400 and answer["error"]["param"] == "cache_salt", (salt, answer)
