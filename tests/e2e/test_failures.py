"""Workers and transfers that fail: a prefill never picked up, a silent or killed ctx during the KV
pickup, a dead gen world rank (its world restarts), a killed gen worker; each fails within its
bound with an error naming the cause, leaves nothing allocated, and the deployment recovers."""

from __future__ import annotations

import http.client as httplib
import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from helixserve.config import RestartPolicy
from helixserve.testing.servers import SECRET_HEADER, secret_for
from tests.e2e.conftest import MODEL, Deployment, http, metric, wait_until

TRANSFER_TIMEOUT_S = 3.0
# a receiver that gives up asks the ctx to stop (rpc timeout) and drains (drain timeout)
FAIL_BOUND_S = TRANSFER_TIMEOUT_S + 2 * 1.0 + 2.0


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"transceiver": {"kv_transfer_timeout_ms": TRANSFER_TIMEOUT_S * 1000},
            "ctx": {"pickup_timeout_s": 3.0}, "gen": {"world_restart": RestartPolicy(backoff_s=2.0)}}


def _ask(dep: Deployment, max_tokens: int = 3) -> str:
    r = dep.client(timeout=30).completions.create(model=MODEL, prompt="ping", max_tokens=max_tokens,
                                                  temperature=0)
    return r.choices[0].finish_reason


def _decode_on_gen(dep: Deployment, params: dict, out: dict) -> None:
    began = time.monotonic()
    out["answer"] = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": "ignored: the ctx ids count", "max_tokens": 8, "temperature": 0,
        "disaggregated_params": params}, timeout=60)
    out["elapsed"] = time.monotonic() - began


def _open_stream(url: str, body: dict) -> httplib.HTTPConnection:
    parsed = urlparse(url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               SECRET_HEADER: secret_for(url) or ""})
    return conn


def _ctx_endpoint(params: dict) -> str:
    return f"{params['ctx_endpoint']['host']}:{params['ctx_endpoint']['port']}"


def test_unpicked_prefill_expires_and_frees_its_cache(dep):
    params = dep.prefill_on_ctx(list(range(20)))
    assert params["prompt_token_ids"] == list(range(20)) and len(params["first_gen_tokens"]) == 1
    assert params["layout"]["tokens_per_block"] == 4 and params["ctx_endpoint"]["port"] > 0
    assert dep.stats("ctx")["num_held"] == 1 and dep.stats("ctx")["num_used_blocks"] == 5
    wait_until(lambda: dep.stats("ctx")["num_used_blocks"] == 0, 10, "the hold to expire")
    wait_until(lambda: metric(dep.ctx_url, "helixserve_worker_pickups_expired_total") == 1, 5,
               "the expiry to be counted")
    # the gen world asks for it anyway: the ctx refuses, every rank fails it, nothing stays
    out: dict = {}
    _decode_on_gen(dep, params, out)
    status, err = out["answer"]
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    message = err["error"]["message"]
    assert f"ctx worker {_ctx_endpoint(params)}" in message and "is not held here" in message
    assert "to gen rank" in message  # the first rank(s) to report it
    wait_until(dep.is_idle, 5, "nothing allocated on ctx and gen")


def test_gen_rejects_a_mismatched_layout(dep):
    params = dep.prefill_on_ctx([5, 6, 7])
    params["layout"] = {**params["layout"], "tokens_per_block": 64}
    status, err = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "disaggregated_params": params})
    assert status == 400 and err["error"]["code"] == "layout_mismatch"
    assert "tokens_per_block: 4 != 64" in err["error"]["message"]
    wait_until(dep.is_idle, 5, "the unpicked hold to expire")


def test_silent_ctx_times_the_transfer_out_on_every_rank(dep):
    """The ctx worker stops answering (SIGSTOP) after its prefill: the gen world's pickup times
    out within kv_transfer_timeout_ms, the client gets a 504 naming the ctx, gen frees all."""
    params = dep.prefill_on_ctx(list(range(30, 47)))
    os.killpg(dep.procs["ctx"].pid, signal.SIGSTOP)
    out: dict = {}
    try:
        _decode_on_gen(dep, params, out)
    finally:
        os.killpg(dep.procs["ctx"].pid, signal.SIGCONT)
    status, err = out["answer"]
    assert status == 504 and err["error"]["code"] == "kv_transfer_timeout", err
    assert f"ctx worker {_ctx_endpoint(params)}" in err["error"]["message"]
    assert out["elapsed"] < FAIL_BOUND_S  # (the RequestShard call alone is bounded by rpc_timeout)
    wait_until(dep.is_idle, 10, "nothing allocated on gen, the ctx hold expired")
    dep.wait_ready()  # the router saw the ctx answer its health checks again
    assert _ask(dep) == "length"


def test_client_gone_during_the_pickup_frees_ctx_and_every_gen_rank(dep):
    """The client leaves while the CP ranks wait for their shards: each rank cancels its
    transfer (the ctx stops serving it) and frees its blocks; the router's abort frees the ctx."""
    def ended() -> float:  # cancelled, or expired if the frozen ctx saw its hold deadline first
        return (metric(dep.ctx_url, "helixserve_worker_kv_transfers_cancelled_total")
                + metric(dep.ctx_url, "helixserve_worker_pickups_expired_total"))

    before = ended()
    params = dep.prefill_on_ctx(list(range(100, 123)))
    os.killpg(dep.procs["ctx"].pid, signal.SIGSTOP)  # the pickup stays pending
    try:
        conn = _open_stream(dep.gen_url, {"model": MODEL, "prompt": [1], "max_tokens": 8, "stream": True,
                                          "disaggregated_params": params})
        wait_until(lambda: dep.stats("gen")["num_used_blocks"] > 0, 15, "gen allocating the shards")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        wait_until(lambda: dep.stats("gen")["num_live_requests"] == 0, 15, "gen aborting it")
    finally:
        os.killpg(dep.procs["ctx"].pid, signal.SIGCONT)
    http("POST", f"{dep.ctx_url}/v1/abort", {"request_id": params["ctx_request_id"]})  # as the router does
    wait_until(dep.is_idle, 10, "nothing allocated on ctx and gen",
               state=lambda: {"ctx": dep.stats("ctx"), "gen": dep.stats("gen")})
    assert ended() == before + 1
    dep.wait_ready()
    assert _ask(dep) == "length"


def test_ctx_killed_mid_pickup_fails_fast_then_router_recovers(dep):
    params = dep.prefill_on_ctx(list(range(60, 90)))
    os.killpg(dep.procs["ctx"].pid, signal.SIGSTOP)  # the pickup hangs on it...
    out: dict = {}
    decode = threading.Thread(target=_decode_on_gen, args=(dep, params, out))
    decode.start()
    wait_until(lambda: dep.stats("gen")["num_used_blocks"] > 0, 5, "gen allocating the shards")
    began = time.monotonic()
    dep.kill("ctx")  # ... then it dies
    decode.join(FAIL_BOUND_S + 5)
    status, err = out["answer"]
    assert status in (503, 504) and err["error"]["code"] in ("kv_transfer_failed", "kv_transfer_timeout")
    assert f"ctx worker {_ctx_endpoint(params)}" in err["error"]["message"]
    assert time.monotonic() - began < FAIL_BOUND_S and out["elapsed"] < FAIL_BOUND_S
    wait_until(lambda: dep.stats("gen")["num_used_blocks"] == dep.stats("gen")["num_live_requests"] == 0,
               5, "gen freeing every rank's shard")
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match=f"ctx worker.*{dep.ctx_url}") as info:
        _ask(dep)
    assert info.value.status_code == 503 and time.monotonic() - t0 < 3
    dep.start("ctx")
    dep.wait_ready()
    assert _ask(dep) == "length"
    healthy = http("GET", f"{dep.router_url}/metrics")[1]
    assert f'helixserve_router_worker_healthy{{role="ctx",url="{dep.ctx_url}"}} 1.0' in healthy


def test_dead_world_rank_fails_requests_fast_then_the_world_restarts(dep):
    stream = dep.client().completions.create(model=MODEL, prompt="long", max_tokens=200,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    next(iter(stream))
    (rank1,) = dep.rank_pids()
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    with pytest.raises(openai.APIError, match=f"gen world rank 1 \\(pid {rank1}\\) exited") as info:
        for _ in stream:
            pass
    assert info.value.body["code"] == "gen_world_failed"
    assert time.monotonic() - t0 < 5
    # the restart waits world_restart.backoff_s (2 s here): meanwhile the worker says why
    status, health = http("GET", f"{dep.gen_url}/health")
    assert status == 503 and f"gen world rank 1 (pid {rank1}) exited" in health["status"]
    assert "restart" in health["status"]
    wait_until(lambda: http("GET", f"{dep.router_url}/ready")[0] == 503, 5, "the router to notice")
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match=f"gen worker.*{dep.gen_url}.*rank 1") as info:
        _ask(dep)
    assert info.value.status_code == 503 and time.monotonic() - t0 < 3
    wait_until(dep_ctx_idle(dep), 5, "the ctx hold to be freed")
    dep.wait_ready()  # the gen worker restarted its world by itself
    assert rank1 not in dep.rank_pids()
    assert _ask(dep) == "length"
    # a rank's death is what an operator alerts on: one ERROR line naming it
    assert (f"ERROR helixserve.serving.world_supervisor: gen world failed: gen world rank 1 (pid {rank1}) exited"
            in (dep.log_dir / "gen.log").read_text())


def dep_ctx_idle(dep: Deployment):  # noqa: ANN201
    return lambda: dep.stats("ctx")["num_used_blocks"] == 0 and dep.stats("ctx")["pickups_held"] == 0


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
    wait_until(dep_ctx_idle(dep), 5, "the ctx hold to be freed")
    dep.start("gen")
    dep.wait_ready()
    assert _ask(dep) == "length"
