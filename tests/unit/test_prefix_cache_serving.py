"""Prefix caching through a real ctx worker (its app served by uvicorn on loopback, the tiny K3
checkpoint): completions sharing a prefix answer the tokens of a worker with caching off, report
``usage.prompt_tokens_details.cached_tokens``, keep salts apart, ``/metrics`` counts the
queries and hits under our names and vLLM's, and ``/v1/prefix_events`` names the blocks cached."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("uvicorn", reason="server deps not installed")

from helixserve.config import SecurityConfig  # noqa: E402
from helixserve.ctx_server.app import build_ctx_app  # noqa: E402
from helixserve.kvcache.prefix_index import append_block_keys  # noqa: E402
from helixserve.testing.servers import http, new_secret, trust_workers, wait_until  # noqa: E402
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


def test_a_ctx_worker_publishes_the_blocks_it_caches_to_holders_of_the_secret(tiny_checkpoints):
    secret = new_secret()
    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"], prefix_caching=True)
    deploy = deploy.model_copy(update={"security": SecurityConfig(internal_secret=secret)})
    app = build_ctx_app(deploy, deploy.ctx[0])
    with _serving(app, deploy.ctx[0].port) as url:
        trust_workers([url], secret)
        wait_until(lambda: _status(f"{url}/ready") == 200, 120, "the warm-up to finish")
        status, first = http("GET", f"{url}/v1/prefix_events")
        assert status == 200 and first["resync"] and first["tokens_per_block"] == PAGE, first
        prompt = list(range(40, 40 + 3 * PAGE + 1))  # 3 full blocks and one token
        _completion(url, prompt)
        status, after = http("GET", f"{url}/v1/prefix_events?since={first['seq']}")
        assert status == 200 and not after["resync"] and after["epoch"] == first["epoch"], after
        seqs = [seq for seq, _, _ in after["events"]]
        assert seqs == list(range(first["seq"] + 1, after["seq"] + 1))
        stored = [key for _, kind, key in after["events"] if kind == "stored"]
        assert stored[:3] == [k.hex() for k in append_block_keys([], prompt, PAGE, None)]
        status, snapshot = http("GET", f"{url}/v1/prefix_events?max_blocks=1")
        assert snapshot["resync"] and len(snapshot["blocks"]) == 1, snapshot
        for query, param in (("since=-1", "since"), ("since=x", "since"), ("max_blocks=0", "max_blocks")):
            status, answer = http("GET", f"{url}/v1/prefix_events?{query}")
            assert status == 400 and answer["error"]["param"] == param, (query, answer)
        status, answer = http("GET", f"{url}/v1/prefix_events", internal=False)
        assert status == 401, answer
