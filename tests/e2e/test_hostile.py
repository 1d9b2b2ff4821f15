"""Hostile and oversized requests against a served deployment (router -> ctx -> gen on loopback):
every one gets a 4xx OpenAI error body, is counted, and leaves the keep-alive connection usable;
a 4 MB prompt does not stall health checks or other requests; the limits hold at -1 / 0 / +1;
429 says when to retry, 405 what is allowed; a client queued in the router that leaves gives up
its place at once."""

from __future__ import annotations

import http.client as httplib
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from helixserve.config import LimitsConfig
from helixserve.testing.servers import SECRET_HEADER, secret_for
from tests.e2e.conftest import MODEL, http, metric, wait_until

MAX_PROMPT_TOKENS = 64  # of a 256-token context
MAX_BODY_BYTES = 4 * 1024 * 1024  # the default
DEEP = 100_000
HOSTILE_BODIES = {
    "lone_surrogate": b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % MODEL.encode(),
    "low_surrogate": b'{"model": "%s", "prompt": "a\\udc00b", "max_tokens": 2}' % MODEL.encode(),
    "deep_nesting": (b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * DEEP + b"]" * DEEP
                     + b"}"),
    "deep_object": b'{"model": "%s", "user": ' % MODEL.encode() + b'{"a":' * DEEP + b"1"
                   + b"}" * DEEP + b"}",
    "nan": b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(),
    "infinity": b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % MODEL.encode(),
    "bad_utf8": b'{"model": "%s", "prompt": "\xff\xfe"}' % MODEL.encode(),
    "not_an_object": b"[1, 2, 3]",
    "huge_integer": b'{"model": "%s", "prompt": [1], "max_tokens": 1%s}' % (MODEL.encode(),
                                                                         b"0" * 4000),
    "fractional_top_k": b'{"model": "%s", "prompt": "hi", "top_k": 76.5}' % MODEL.encode(),
    "top_k_2_63": b'{"model": "%s", "prompt": "hi", "top_k": 9223372036854775808}' % MODEL.encode(),
    "top_k_1e30": b'{"model": "%s", "prompt": "hi", "top_k": 1e30}' % MODEL.encode(),
    "temperature_1e999": b'{"model": "%s", "prompt": "hi", "temperature": 1e999}' % MODEL.encode(),
}
# (parameter, JSON value) out of range, sent among well-formed requests
OUT_OF_RANGE = [("top_k", b"9223372036854775808"), ("top_k", b"1e30"), ("top_k", b"2147483648"),
                ("seed", b"18446744073709551616"), ("max_tokens", b"2147483648"), ("top_p", b"1e999")]


HEADER_TIMEOUT_S = 3.0  # the workers close a connection that sent no request this long


@pytest.fixture(scope="module")
def dep_options() -> dict:
    connections = {"connections": {"timeout_header_s": HEADER_TIMEOUT_S}}
    return {"limits": LimitsConfig(max_prompt_tokens=MAX_PROMPT_TOKENS), "ctx": connections, "gen": connections}


def _conn(url: str, timeout: float = 60) -> httplib.HTTPConnection:
    """A keep-alive connection to ``url``; to a worker it presents the deployment's internal
    secret, as the router does (the hostile body, not the caller, is under test)."""
    parsed = urlparse(url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    secret = secret_for(url)
    conn.internal_headers = {SECRET_HEADER: secret} if secret else {}  # type: ignore[attr-defined]
    return conn


def _send(conn: httplib.HTTPConnection, method: str, path: str, body: bytes | None = None,
          headers: dict | None = None) -> tuple[int, dict, object]:
    conn.request(method, path, body, {"Content-Type": "application/json",
                                      **getattr(conn, "internal_headers", {}), **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = raw.decode(errors="replace")
    return response.status, dict(response.getheaders()), payload


def _good(prompt: object = "ok", **extra: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                       **extra}).encode()


def _counter(url: str, labels: str) -> float:
    name = "helixserve_router_requests_total" if "endpoint" in labels \
        else "helixserve_worker_requests_total"
    return metric(url, f"{name}{{{labels}}}", default=0.0)


def _assert_openai_error(status: int, payload: object, expected: int, code: str | None = None,
                         param: str | None = None) -> dict:
    assert status == expected, payload
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
@pytest.mark.parametrize("role", ["router", "ctx", "gen"])
def test_hostile_body_is_a_counted_4xx_and_the_connection_stays_usable(dep, role, name):
    url = {"router": dep.router_url, "ctx": dep.ctx_url, "gen": dep.gen_url}[role]
    labels = ('endpoint="/v1/completions",status="400"' if role == "router"
              else f'role="{role}",status="400"')
    before = _counter(url, labels)
    conn = _conn(url)
    try:
        status, _, payload = _send(conn, "POST", "/v1/completions", HOSTILE_BODIES[name])
        _assert_openai_error(status, payload, 400)
        local = conn.sock.getsockname()
        status, _, payload = _send(conn, "POST", "/v1/completions", _good())
        assert status == 200, payload
        assert conn.sock is not None and conn.sock.getsockname() == local  # same connection
    finally:
        conn.close()
    assert _counter(url, labels) == before + 1


def test_integral_float_top_k_is_accepted(dep):
    status, answer = http("POST", f"{dep.router_url}/v1/completions",
                          json.loads(_good(top_k=76.0, max_tokens=3.0)))
    assert status == 200 and answer["usage"]["completion_tokens"] <= 3, answer
    status, answer = http("POST", f"{dep.router_url}/v1/completions", json.loads(_good(top_k=76.5)))
    error = _assert_openai_error(status, answer, 400, code="invalid_type", param="top_k")
    assert "76.5" in error["message"]


def _post_raw(url: str, body: bytes) -> tuple[int, object]:
    conn = _conn(url)
    try:
        status, _, payload = _send(conn, "POST", "/v1/completions", body)
        return status, payload
    finally:
        conn.close()


def test_out_of_range_parameters_are_400s_and_the_requests_beside_them_get_their_tokens(dep):
    """Out-of-range parameters sent at once with 24 greedy requests: each a 400 naming the
    parameter; every greedy request answers as it does alone."""
    prompts = [f"request {i} of the batch" for i in range(24)]
    alone = [http("POST", f"{dep.router_url}/v1/completions", json.loads(_good(p, max_tokens=4)))
             for p in prompts]
    assert all(status == 200 for status, _ in alone), alone
    bad = [b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (MODEL.encode(), name.encode(), raw)
           for name, raw in OUT_OF_RANGE]
    with ThreadPoolExecutor(len(prompts) + len(bad)) as pool:
        refused = [pool.submit(_post_raw, dep.router_url, body) for body in bad[:3]]
        answers = [pool.submit(_post_raw, dep.router_url, _good(p, max_tokens=4)) for p in prompts]
        refused += [pool.submit(_post_raw, dep.router_url, body) for body in bad[3:]]
        for (name, raw), future in zip(OUT_OF_RANGE, refused):
            status, payload = future.result()
            _assert_openai_error(status, payload, 400, param=name)
        for (_, want), future in zip(alone, answers):
            status, got = future.result()
            assert status == 200, got
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["usage"] == want["usage"]


@pytest.mark.parametrize("role", ["router", "ctx", "gen"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_over_limit_body_is_413(dep, role, chunked):
    url = {"router": dep.router_url, "ctx": dep.ctx_url, "gen": dep.gen_url}[role]
    body = _good("x" * (MAX_BODY_BYTES + 1))
    conn = _conn(url)
    try:
        if chunked:  # no Content-Length: the server counts what it reads
            parts = (body[i:i + 65536] for i in range(0, len(body), 65536))
            conn.request("POST", "/v1/completions", parts,
                         {"Content-Type": "application/json", **conn.internal_headers},
                         encode_chunked=True)
        else:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json", **conn.internal_headers})
        response = conn.getresponse()
        payload = json.loads(response.read())
    finally:
        conn.close()
    _assert_openai_error(response.status, payload, 413, code="request_too_large")
    assert str(MAX_BODY_BYTES) in payload["error"]["message"]
    assert http("POST", f"{url}/v1/completions", json.loads(_good()))[0] == 200


def test_four_megabyte_prompts_leave_health_and_other_requests_answered(dep):
    """The 4 MB prompts are refused before tokenizing (their byte count proves they cannot fit),
    their parsing runs off the event loop: health checks and small requests go on meanwhile."""
    big_text = {"model": MODEL, "prompt": "a" * 4_000_000, "max_tokens": 2}
    big_ids = {"model": MODEL, "prompt": [7] * 1_300_000, "max_tokens": 2}  # 3.9 MB of JSON
    targets = [(dep.router_url, big_text), (dep.ctx_url, big_text), (dep.router_url, big_ids),
               (dep.ctx_url, big_ids), (dep.router_url, big_text), (dep.ctx_url, big_text)]
    done = threading.Event()
    small: list[tuple[int, object]] = []
    health: list[int] = []

    def meanwhile() -> None:
        while not done.is_set() or not small:
            for url in (dep.ctx_url, dep.router_url):
                health.append(http("GET", f"{url}/health", timeout=30)[0])
            small.append(http("POST", f"{dep.router_url}/v1/completions",
                              json.loads(_good("small")), timeout=60))

    with ThreadPoolExecutor(len(targets) + 1) as pool:
        side = pool.submit(meanwhile)
        try:
            bigs = [pool.submit(http, "POST", f"{url}/v1/completions", body, None, 120)
                    for url, body in targets]
            answers = [f.result() for f in bigs]
        finally:
            done.set()
        side.result()
    for status, answer in answers:
        _assert_openai_error(status, answer, 400, code="context_length_exceeded", param="prompt")
    assert health and set(health) == {200}, health
    assert small and all(status == 200 for status, _ in small), small


@pytest.mark.parametrize("role", ["router", "ctx"])
def test_max_prompt_tokens_at_the_limit(dep, role):
    url = dep.router_url if role == "router" else dep.ctx_url
    ids = list(range(40, 40 + MAX_PROMPT_TOKENS + 1))
    for n in (MAX_PROMPT_TOKENS - 1, MAX_PROMPT_TOKENS):
        status, answer = http("POST", f"{url}/v1/completions", json.loads(_good(ids[:n])))
        assert status == 200 and answer["usage"]["prompt_tokens"] == n, answer
        status, answer = http("POST", f"{url}/v1/completions", json.loads(_good("b" * n)))
        assert status == 200 and answer["usage"]["prompt_tokens"] == n, answer  # a byte a token
    for prompt in (ids, "b" * (MAX_PROMPT_TOKENS + 1)):
        status, answer = http("POST", f"{url}/v1/completions", json.loads(_good(prompt)))
        error = _assert_openai_error(status, answer, 400, code="context_length_exceeded",
                                     param="prompt")
        assert str(MAX_PROMPT_TOKENS) in error["message"]
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "c" * 5000}]}
    status, answer = http("POST", f"{url}/v1/chat/completions", chat)
    _assert_openai_error(status, answer, 400, code="context_length_exceeded", param="messages")


@pytest.mark.parametrize("role", ["router", "ctx", "gen"])
def test_405_names_the_allowed_methods(dep, role):
    url = {"router": dep.router_url, "ctx": dep.ctx_url, "gen": dep.gen_url}[role]
    conn = _conn(url)
    try:
        status, headers, payload = _send(conn, "GET", "/v1/completions")
    finally:
        conn.close()
    _assert_openai_error(status, payload, 405)
    assert headers.get("allow") == "POST", headers


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_abort_of_an_unknown_request_says_so(dep, role):
    url = dep.ctx_url if role == "ctx" else dep.gen_url
    status, answer = http("POST", f"{url}/v1/abort", {"request_id": "no-such-request"})
    assert (status, answer) == (200, {"request_id": "no-such-request", "aborted": False})


def test_models_created_is_the_start_time(dep):
    now = time.time()
    for url in (dep.router_url, dep.ctx_url, dep.gen_url):
        status, answer = http("GET", f"{url}/v1/models")
        assert status == 200
        created = answer["data"][0]["created"]
        assert now - 3600 < created <= now, answer


def _leave(conn: httplib.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_429_has_retry_after_and_a_queued_client_that_leaves_frees_its_place(dep, tmp_path):
    """One slot, one queue place. A holds the slot (its gen world is paused mid-decode), B takes
    the queue place, C gets 429 with Retry-After; B leaves and its place is free at once: D
    queues instead of getting 429, while A still holds the slot."""
    url, proc = dep.extra_router(tmp_path, max_inflight=1, max_queue_len=1)
    waiting = "helixserve_router_requests_waiting"
    gen_group = dep.procs["gen"].pid
    long_stream = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0,
                   "ignore_eos": True, "stream": True}
    a = _conn(url)
    is_paused = False
    try:
        a.request("POST", "/v1/completions", json.dumps(long_stream),
                  {"Content-Type": "application/json"})
        response = a.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        os.killpg(gen_group, signal.SIGSTOP)  # A cannot finish: the slot stays taken
        is_paused = True
        b = _conn(url)
        b.request("POST", "/v1/completions", _good(), {"Content-Type": "application/json"})
        wait_until(lambda: metric(url, waiting) == 1, 10, "B queued")
        c = _conn(url)
        try:
            status, headers, payload = _send(c, "POST", "/v1/completions", _good())
        finally:
            c.close()
        _assert_openai_error(status, payload, 429)
        assert int(headers.get("retry-after", "0")) >= 1, headers
        _leave(b)
        wait_until(lambda: metric(url, waiting) == 0, 10, "B's queue place freed")
        d = _conn(url)
        d.request("POST", "/v1/completions", _good(), {"Content-Type": "application/json"})
        wait_until(lambda: metric(url, waiting) == 1, 10, "D queued (not refused)")
        assert metric(url, "helixserve_router_requests_running") == 1  # A still holds the slot
        _leave(d)
        wait_until(lambda: metric(url, waiting) == 0, 10, "D's queue place freed")
        counted = 'helixserve_router_requests_total{endpoint="/v1/completions",status="499"}'
        assert metric(url, counted) == 2  # B and D
    finally:
        if is_paused:
            os.killpg(gen_group, signal.SIGCONT)
        a.close()
        proc.terminate()
        proc.wait(10)
    wait_until(lambda: http("GET", f"{dep.router_url}/ready")[0] == 200, 30, "gen healthy again")
    assert http("POST", f"{dep.router_url}/v1/completions", json.loads(_good()))[0] == 200


def _closed_by(url: str, role: str, reason: str) -> float:
    return metric(url, f'helixserve_worker_connections_closed_total{{reason="{reason}",role="{role}"}}', default=0.0)


def test_workers_export_their_connection_counts(dep):
    """A worker's ``/metrics`` shows its connection guard as the router's does: open connections
    now, and those it closed by reason (an idle one here, closed at its header deadline,
    ``HEADER_TIMEOUT_S``)."""
    urls = {"ctx": dep.ctx_url, "gen": dep.gen_url}
    before = {role: _closed_by(url, role, "idle_timeout") for role, url in urls.items()}
    idle = {role: socket.create_connection((urlparse(url).hostname, urlparse(url).port), timeout=30)
            for role, url in urls.items()}
    try:
        for role, url in urls.items():
            # this idle socket and the scrape's own connection
            assert metric(url, f'helixserve_worker_connections_open{{role="{role}"}}') >= 2
        for sock in idle.values():
            assert sock.recv(1) == b""  # the worker closes it (bounded by the socket's timeout)
        for role, url in urls.items():
            assert _closed_by(url, role, "idle_timeout") == before[role] + 1
    finally:
        for sock in idle.values():
            sock.close()
