"""The router's ``/metrics`` carry vLLM's metric names beside ours, so dashboards built for vLLM
read a helixserve deployment: each ``vllm:*`` alias has vLLM's type and ``model_name`` label and,
in the same scrape, exactly our metric's samples (every histogram bucket, count and sum; counter
totals; gauges), after streamed and non-streamed requests through the ``openai`` client and while
a stream holds gen's cache blocks (KV usage = used / total blocks of each worker, running = 1)."""

from __future__ import annotations

import http.client as httplib
import json
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, Deployment, http, wait_until

SHARED_DEPLOYMENT = "disagg"  # conftest: one deployment for these modules

# vLLM name -> (our name, type): vllm/v1/metrics/loggers.py; the ITL histogram has two vLLM names
ALIASES = {
    "vllm:time_to_first_token_seconds": ("helixserve_router_time_to_first_token_seconds", "histogram"),
    "vllm:inter_token_latency_seconds": ("helixserve_router_inter_token_latency_seconds", "histogram"),
    "vllm:time_per_output_token_seconds": ("helixserve_router_inter_token_latency_seconds", "histogram"),
    "vllm:e2e_request_latency_seconds": ("helixserve_router_e2e_request_latency_seconds", "histogram"),
    "vllm:request_queue_time_seconds": ("helixserve_router_queue_time_seconds", "histogram"),
    "vllm:prompt_tokens": ("helixserve_router_prompt_tokens", "counter"),
    "vllm:generation_tokens": ("helixserve_router_generation_tokens", "counter"),
    "vllm:num_requests_running": ("helixserve_router_requests_running", "gauge"),
    "vllm:num_requests_waiting": ("helixserve_router_requests_waiting", "gauge"),
}
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> tuple[dict[str, str], Samples]:
    """One ``/metrics`` page: ``family -> type`` and ``(sample name, labels) -> value``."""
    status, text = http("GET", f"{url}/metrics")
    assert status == 200
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def assert_aliases_equal_ours(dep: Deployment, types: dict[str, str], samples: Samples) -> None:
    model = ("model_name", MODEL)
    for alias, (ours, kind) in ALIASES.items():
        assert types.get(alias) == kind, (alias, types.get(alias))
        mine = {(name[len(ours):], labels): v for (name, labels), v in samples.items()
                if name.startswith(ours) and name[len(ours):] in ("", "_total", "_bucket", "_count", "_sum")}
        theirs = {(name[len(alias):], labels - {model}): v for (name, labels), v in samples.items()
                  if name.startswith(alias) and not name.endswith("_created")}
        assert mine and theirs == mine, alias
        assert all(model in labels for (name, labels) in samples if name.startswith(alias)), alias
    for alias in KV_USAGE:
        assert types.get(alias) == "gauge", alias
        for role in ("ctx", "gen"):
            labels = {("role", role), ("url", {"ctx": dep.ctx_url, "gen": dep.gen_url}[role])}
            used = samples[("helixserve_router_worker_cache_blocks_used", frozenset(labels))]
            total = samples[("helixserve_router_worker_cache_blocks_total", frozenset(labels))]
            assert total > 0, (role, total)
            assert samples[(alias, frozenset({*labels, model}))] == used / total, (alias, role)


def test_vllm_names_equal_ours_after_requests_and_while_a_stream_holds_the_cache(dep: Deployment):
    model = frozenset({("model_name", MODEL)})
    before = scrape(dep.router_url)[1]  # the deployment is shared: counts move from here
    client = dep.client()
    for i in range(3):  # streamed: TTFT and ITL; usage counts prompt and generated tokens
        chunks = list(client.completions.create(
            model=MODEL, prompt=list(range(10 + i, 20 + 3 * i)), max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 6
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1

    types, samples = scrape(dep.router_url)
    assert_aliases_equal_ours(dep, types, samples)

    def moved(name: str) -> float:
        return samples[(name, model)] - before.get((name, model), 0.0)
    # the three streams (a non-streamed answer has no first-token time)
    assert moved("vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:prompt_tokens_total") > 0
    assert moved("vllm:generation_tokens_total") >= 3 * 6 + 1

    # a stream held open: gen holds its blocks, the router one running request
    parsed = urlparse(dep.router_url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    body = {"model": MODEL, "prompt": list(range(30)), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    try:
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        gen = frozenset({("model_name", MODEL), ("role", "gen"), ("url", dep.gen_url)})

        def held() -> bool:
            return scrape(dep.router_url)[1][("vllm:kv_cache_usage_perc", gen)] > 0
        wait_until(held, 10, "the router to see gen's blocks in use")
        types, samples = scrape(dep.router_url)
        assert_aliases_equal_ours(dep, types, samples)
        assert 0 < samples[("vllm:kv_cache_usage_perc", gen)] < 1
        assert samples[("vllm:num_requests_running", model)] == 1
    finally:
        response.read()
        conn.close()
