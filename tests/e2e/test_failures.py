"""Workers that die, come back, or never get their prefill picked up."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.conftest import MODEL, Deployment, http, metric, wait_until

pytest.importorskip("fastapi", reason="server deps (fastapi, uvicorn, httpx, prometheus-client) not installed")


@pytest.fixture(scope="module")
def dep(tmp_path_factory, k3_tiny):
    d = Deployment(tmp_path_factory.mktemp("failures"), k3_tiny)
    d.config = d.config.model_copy(update={"ctx": [d.config.ctx[0].model_copy(
        update={"pickup_timeout_s": 1.0})]})
    d.config.to_yaml(d.config_file)
    try:
        yield d.start_all()
    finally:
        d.stop()


def _ask(dep: Deployment, max_tokens: int = 3) -> str:
    r = dep.client(timeout=30).completions.create(model=MODEL, prompt="ping", max_tokens=max_tokens,
                                                  temperature=0)
    return r.choices[0].finish_reason


def test_unpicked_prefill_expires_and_frees_its_cache(dep):
    status, answer = http("POST", f"{dep.ctx_url}/v1/completions", {
        "model": MODEL, "prompt": list(range(20)), "max_tokens": 8, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only"}})
    assert status == 200 and answer["choices"][0]["finish_reason"] is None
    params = answer["disaggregated_params"]
    assert params["prompt_token_ids"] == list(range(20)) and len(params["first_gen_tokens"]) == 1
    assert params["layout"]["tokens_per_block"] == 4 and params["ctx_endpoint"]["port"] > 0
    assert dep.stats("ctx")["num_held"] == 1 and dep.stats("ctx")["num_used_blocks"] == 5
    wait_until(lambda: dep.stats("ctx")["num_used_blocks"] == 0, 10, "the hold to expire")
    assert metric(dep.ctx_url, "helixserve_worker_pickups_expired_total") == 1
    # a generation_only request for the same prompt still decodes (recompute fallback)
    gen_params = {**params, "request_type": "generation_only"}
    status, out = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": "ignored: the ctx ids count", "max_tokens": 8, "temperature": 0,
        "disaggregated_params": gen_params})
    status_agg, agg = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": list(range(20)), "max_tokens": 8, "temperature": 0})
    assert status == status_agg == 200
    assert out["choices"] == agg["choices"] and out["usage"] == agg["usage"]


def test_gen_rejects_a_mismatched_layout(dep):
    _, answer = http("POST", f"{dep.ctx_url}/v1/completions", {
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only"}})
    params = {**answer["disaggregated_params"], "request_type": "generation_only"}
    params["layout"] = {**params["layout"], "tokens_per_block": 64}
    status, err = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "disaggregated_params": params})
    assert status == 400 and err["error"]["code"] == "layout_mismatch"
    assert "tokens_per_block: 4 != 64" in err["error"]["message"]
    http("POST", f"{dep.ctx_url}/v1/release", {"request_id": params["ctx_request_id"]})


def test_killed_gen_fails_its_stream_fast_then_rejoins(dep):
    stream = dep.client().completions.create(model=MODEL, prompt="long", max_tokens=200,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    next(iter(stream))
    t0 = time.monotonic()
    dep.kill("gen")
    with pytest.raises(openai.APIError, match=f"gen worker {dep.gen_url} failed mid-stream"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match=f"gen worker.*{dep.gen_url}") as info:
        _ask(dep)
    assert info.value.status_code == 503 and time.monotonic() - t0 < 3
    assert http("GET", f"{dep.router_url}/ready")[0] == 503
    assert dep.stats("ctx")["num_used_blocks"] == 0  # the failed request's hold was cancelled
    dep.start("gen")
    dep.wait_ready()
    assert _ask(dep) == "length"


def test_killed_ctx_fails_fast_naming_it_then_rejoins(dep):
    dep.kill("ctx")
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match=f"ctx worker.*{dep.ctx_url}") as info:
        _ask(dep)
    assert info.value.status_code == 503 and time.monotonic() - t0 < 3
    dep.start("ctx")
    dep.wait_ready()
    assert _ask(dep) == "length"
    healthy = http("GET", f"{dep.router_url}/metrics")[1]
    assert f'helixserve_router_worker_healthy{{role="ctx",url="{dep.ctx_url}"}} 1.0' in healthy
