"""At the served level: the internal ports trust only the deployment.

A caller without the internal secret gets 401 (OpenAI's error body) from every worker route but
``/health`` and ``/metrics``, so it cannot take another request's answer, cancel it or release
it; ctx request ids are unguessable; an error body tells nothing of another request's tokens; gen
dials only the deployment's ctx transceivers; no process of the deployment listens on a wildcard
address; a router that lacks the secret reports its workers unhealthy, naming it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helixserve.config import INTERNAL_SECRET_ENV
from helixserve.testing.servers import SECRET_HEADER
from tests.e2e.conftest import MODEL, REPO, Deployment, free_ports, http, wait_until

SHARED_DEPLOYMENT = "disagg"  # conftest: one deployment for these modules

WILDCARDS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and :: in /proc/net/tcp*


def _prefill(dep: Deployment, prompt: list[int], **headers: str) -> dict:
    """A context_only request as the router sends it: the generation_only params."""
    status, answer = http("POST", f"{dep.ctx_url}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "disaggregated_params": {"request_type": "context_only"}}, headers=headers)
    assert status == 200 and answer["choices"][0]["finish_reason"] is None, answer
    return {**answer["disaggregated_params"], "request_type": "generation_only"}


def _decode(dep: Deployment, params: dict, prompt: list[int], internal: bool = True) -> tuple[int, dict]:
    return http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "disaggregated_params": params}, internal=internal, timeout=60)


def _assert_openai_error(status: int, body: dict, code: int) -> None:
    assert status == code, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body


def _release(dep: Deployment, params: dict) -> None:
    http("POST", f"{dep.ctx_url}/v1/release", {"request_id": params["ctx_request_id"],
                                               "admission": params["ctx_admission"]})
    wait_until(dep.is_idle, 10, "nothing held or allocated", state=lambda: (dep.stats("ctx"), dep.stats("gen")))


def test_workers_answer_only_callers_holding_the_internal_secret(dep):
    plain = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    routes = [("POST", "/v1/completions", plain), ("POST", "/v1/chat/completions", chat),
              ("POST", "/v1/completions", {**plain, "disaggregated_params": {"request_type": "context_only"}}),
              ("POST", "/v1/abort", {"request_id": "x"}), ("GET", "/v1/models", None), ("GET", "/stats", None)]
    release = ("POST", "/v1/release", {"request_id": "x", "admission": 1})
    for url in (dep.ctx_url, dep.gen_url):
        for method, path, body in [*routes, *([release] if url == dep.ctx_url else [])]:
            for headers in ({}, {SECRET_HEADER: "guessed"}, {SECRET_HEADER: dep.secret + "x"}, {SECRET_HEADER: ""}):
                status, answer = http(method, f"{url}{path}", body, headers=headers, internal=False)
                _assert_openai_error(status, answer, 401)
                assert answer["error"]["code"] == "invalid_internal_secret"
                assert dep.secret not in str(answer)
        for path in ("/health", "/metrics"):  # liveness and counters stay open (no request data)
            assert http("GET", f"{url}{path}", internal=False)[0] == 200
        assert http("GET", f"{url}/v1/models")[0] == 200  # the deployment's own callers pass
    answer = dep.client().completions.create(model=MODEL, prompt="hello", max_tokens=3)  # via the router
    assert answer.usage.completion_tokens == 3
    assert dep.stats("ctx")["num_live_requests"] == 0


def test_a_stranger_cannot_take_cancel_or_release_another_requests_answer(dep):
    """The attack of finding 3: generation_only straight to gen naming a held request's
    ctx_request_id with a dummy prompt of the same length. Refused before anything is touched;
    the request's own pickup still decodes the right answer."""
    prompt = list(range(40, 57))
    params = _prefill(dep, prompt)
    dummy = [7] * len(prompt)
    stolen = {**params, "prompt_token_ids": dummy}
    for guess in ([params["first_gen_tokens"][0]], [0]):  # even with the right first token
        status, answer = _decode(dep, {**stolen, "first_gen_tokens": guess}, dummy, internal=False)
        _assert_openai_error(status, answer, 401)
        assert "choices" not in answer
    for path in ("/v1/abort", "/v1/release"):
        _assert_openai_error(*http("POST", f"{dep.ctx_url}{path}", {"request_id": params["ctx_request_id"]},
                                   internal=False), 401)
    assert dep.stats("ctx")["pickups_held"] == 1 and dep.stats("gen")["num_live_requests"] == 0
    status, answer = _decode(dep, params, prompt)  # the router's own pickup: the real answer
    assert status == 200, answer
    status, agg = http("POST", f"{dep.gen_url}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200 and answer["choices"][0]["text"] == agg["choices"][0]["text"]
    wait_until(dep.is_idle, 10, "nothing held or allocated")


def test_ctx_request_ids_are_unguessable(dep):
    ids = []
    for _ in range(3):
        params = _prefill(dep, list(range(3, 12)))  # no X-Request-Id: the worker names it
        ids.append(params["ctx_request_id"])
        _release(dep, params)
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"ctx-[0-9a-f]{32}", i) for i in ids), ids


def test_an_error_body_discloses_nothing_of_another_request(dep):
    """A generation_only (from a caller holding the secret: a confused router) whose first token
    differs from what ctx holds fails without telling the held request's true first token."""
    prompt = list(range(60, 75))
    params = _prefill(dep, prompt)
    true_first = params["first_gen_tokens"][0]
    status, err = _decode(dep, {**params, "first_gen_tokens": [true_first ^ 1]}, prompt)
    assert 400 <= status < 600 and status != 200, err
    message = err["error"]["message"]
    assert "holds a different prefill" in message
    assert f"[{true_first}]" not in message and "first tokens" not in message, message
    wait_until(dep.is_idle, 30, "nothing held or allocated", state=lambda: (dep.stats("ctx"), dep.stats("gen")))


def test_gen_dials_only_ctx_endpoints_of_the_deployment(dep):
    prompt = list(range(80, 93))
    params = _prefill(dep, prompt)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        rogue = {**params, "ctx_endpoint": {"host": "127.0.0.1", "port": listener.getsockname()[1]}}
        status, err = _decode(dep, rogue, prompt)
        _assert_openai_error(status, err, 403)
        assert err["error"]["code"] == "ctx_endpoint_not_allowed"
        assert err["error"]["param"] == "disaggregated_params.ctx_endpoint"
        with pytest.raises(BlockingIOError):  # nobody dialled it (gen refused before any connect)
            listener.accept()
    assert dep.stats("gen")["num_live_requests"] == 0 and dep.stats("gen")["num_used_blocks"] == 0
    status, answer = _decode(dep, params, prompt)  # the real endpoint still works
    assert status == 200, answer
    wait_until(dep.is_idle, 10, "nothing held or allocated")


def _listening(pid: int) -> list[tuple[str, str]]:
    """(local address hex, port hex) of every TCP socket in LISTEN that process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(tuple(fields[1].split(":")))
    return found


def test_no_listener_of_the_deployment_binds_a_wildcard_address(dep):
    """HTTP, gRPC, UCX and the gen world's TCPStore / gloo all bind the configured 127.0.0.1."""
    answer = dep.client().completions.create(model=MODEL, prompt="warm", max_tokens=2)  # every plane used
    assert answer.usage.completion_tokens == 2
    pids = [p.pid for p in dep.procs.values()] + [p for p in dep.rank_pids() if p]
    sockets = {pid: _listening(pid) for pid in pids}
    assert all(sockets.values()), sockets  # every process listens somewhere
    wild = {pid: [s for s in found if s[0] in WILDCARDS] for pid, found in sockets.items()}
    assert not any(wild.values()), f"listening on 0.0.0.0 / :: : {wild}"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    others = {pid: [s for s in found if s[0] not in loopback] for pid, found in sockets.items()}
    assert not any(others.values()), f"listening beyond 127.0.0.1: {others}"


@pytest.mark.parametrize("secret", ["", "not-the-deployments"], ids=["no-secret", "wrong-secret"])
def test_a_router_without_the_deployments_secret_says_so_instead_of_relaying_401s(dep, tmp_path, secret):
    (port,) = free_ports(1)
    config = dep.config.model_copy(update={"router": dep.config.router.model_copy(update={"port": port})})
    config.to_yaml(tmp_path / "router.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "router", "-c", str(tmp_path / "router.yaml")],
                            cwd=REPO, start_new_session=True, env={**os.environ, INTERNAL_SECRET_ENV: secret})
    url = f"http://127.0.0.1:{port}"
    try:
        def pools_checked() -> bool:
            try:
                status, ready = http("GET", f"{url}/ready", timeout=2)
            except OSError:
                return False
            return status == 503 and all(w["error"] != "not checked yet" for w in ready["ctx"] + ready["gen"])
        wait_until(pools_checked, 30, "the router's first health checks")
        ready = http("GET", f"{url}/ready")[1]
        for worker in ready["ctx"] + ready["gen"]:
            assert not worker["healthy"] and "health check answered 401" in worker["error"], ready
            assert "internal secret" in worker["error"]
        status, err = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 503 and err["error"]["code"] == "no_healthy_ctx_worker", err
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_release_frees_only_the_admission_it_names(dep):
    """A late ``/v1/release`` of an earlier admission of the same request id (another admission
    number) leaves the current holder's cache alone; its own release frees it."""
    params = _prefill(dep, list(range(60, 77)))
    rid, admission = params["ctx_request_id"], params["ctx_admission"]
    for other in (admission - 1, admission + 1):
        status, answer = http("POST", f"{dep.ctx_url}/v1/release", {"request_id": rid, "admission": other})
        assert (status, answer) == (200, {"request_id": rid, "released": False})
    assert dep.stats("ctx")["pickups_held"] == 1
    status, answer = http("POST", f"{dep.ctx_url}/v1/release", {"request_id": rid})
    _assert_openai_error(status, answer, 400)  # a release must name its admission
    status, answer = http("POST", f"{dep.ctx_url}/v1/release", {"request_id": rid, "admission": admission})
    assert (status, answer) == (200, {"request_id": rid, "released": True})
    wait_until(dep.is_idle, 10, "nothing held or allocated", state=lambda: (dep.stats("ctx"), dep.stats("gen")))
