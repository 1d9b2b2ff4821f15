"""Hostile connections against a real router (uvicorn on loopback, started as ``serve`` starts it)
with short configured deadlines: idle, slow-header and slow-body connections are closed; at the
connection cap the oldest connection without a request gives way so ``/ready`` is still answered;
a client gone mid-body is a 499 in the metrics and no ERROR in the log; a router at a lowered
file-descriptor limit keeps answering under thousands of idle connections."""

from __future__ import annotations

import contextlib
import http.client as httplib
import json
import logging
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helixserve.config import ConnectionsConfig, DeploymentConfig, RouterConfig
from helixserve.router.app import build_router_app
from helixserve.serving.http import build_server
from helixserve.testing.servers import free_ports, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 1.0  # every configured deadline of these servers
NO_WORKERS = ("http://127.0.0.1:1",)  # nothing listens there: /ready answers 503, /health 200


@contextlib.contextmanager
def router(**connections: float) -> Iterator[tuple[int, object]]:
    """A router (no reachable workers) served on a free port; yields ``(port, its guard)``."""
    config = ConnectionsConfig(**{"timeout_keep_alive": DEADLINE_S, "timeout_header_s": DEADLINE_S,
                                  "timeout_body_s": DEADLINE_S, **connections})
    app = build_router_app(RouterConfig(), NO_WORKERS, NO_WORKERS, "m")
    (port,) = free_ports(1)
    server = build_server(app, "127.0.0.1", port, "warning", 1.0, config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "uvicorn")
    try:
        yield port, app.state.connection_guard
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def is_closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(port: int, path: str) -> tuple[int, dict]:
    conn = httplib.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if path != "/metrics" else raw.decode()
    finally:
        conn.close()


def sample(port: int, pattern: str) -> float:
    _, text = get(port, "/metrics")
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(pattern, line)]
    return sum(found)


def test_idle_and_slow_header_connections_are_closed():
    with router() as (port, guard):
        idle = connect(port)
        slow = connect(port)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closer = threading.Thread(target=lambda: [slow.sendall(b"X-A: b\r\n") or time.sleep(0.2)
                                                  for _ in range(30) if not guard.num_closed["header_timeout"]])
        closer.start()
        assert is_closed_by_server(idle)
        assert is_closed_by_server(slow)
        closer.join()
        assert guard.num_closed["idle_timeout"] == 1 and guard.num_closed["header_timeout"] == 1
        assert sample(port, r'helixserve_router_connections_closed_total\{reason="header_timeout"\}') == 1
        assert get(port, "/health")[0] == 200  # the server itself goes on


def test_a_slow_body_is_closed_and_counted_499_not_500(caplog):
    with router() as (port, guard):
        sock = connect(port)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\"")
        for _ in range(3):  # a byte now and then, never the whole body
            sock.sendall(b" ")
            time.sleep(0.2)
        assert is_closed_by_server(sock)
        wait_until(lambda: sample(port, r'helixserve_router_requests_total\{.*status="499"') == 1, 10, "a 499")
        assert sample(port, r'helixserve_router_requests_total\{.*status="500"') == 0
        assert guard.num_closed["body_timeout"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_gone_mid_body_is_a_499_with_no_error_logged(caplog):
    with router(timeout_body_s=30) as (port, _):
        with connect(port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"m\"")
            time.sleep(0.2)
        wait_until(lambda: sample(port, r'helixserve_router_requests_total\{.*status="499"') == 1, 10, "a 499")
        assert sample(port, r'helixserve_router_requests_total\{.*status="500"') == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def held_get(port: int, path: str) -> tuple[int, dict, socket.socket]:
    """GET ``path`` and keep the connection open (kept alive, idle)."""
    conn = httplib.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, json.loads(response.read()), conn.sock


def is_open(sock: socket.socket) -> bool:
    sock.settimeout(0.3)
    try:
        return not is_closed_by_server(sock)
    finally:
        sock.settimeout(10)


def test_at_the_cap_the_oldest_connection_without_a_request_gives_way():
    cap = 8
    with router(timeout_header_s=30, timeout_keep_alive=30, max_connections=cap) as (port, guard):
        idle = [connect(port) for _ in range(cap // 2)]
        slow = [connect(port) for _ in range(cap // 2)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        wait_until(lambda: len(guard.open) == cap, 10, "every connection open")
        status, body, ready_sock = held_get(port, "/ready")  # real readiness, not the cap's 503
        assert (status, body["ready"]) == (503, False)
        assert is_closed_by_server(idle[0]) and is_open(idle[1])  # the oldest idle one made room
        held = [held_get(port, "/health") for _ in range(cap // 2)]
        assert [status for status, _, _ in held] == [200] * (cap // 2)
        assert all(is_closed_by_server(s) for s in idle)
        assert all(is_open(s) for s in slow)  # slow headers go only after every idle one
        assert is_closed_by_server(ready_sock)  # kept alive and idle: older than the next
        assert all(is_open(s) for s in slow)
        assert guard.num_closed["evicted"] == cap // 2 + 1 and len(guard.open) == cap


def test_at_the_cap_with_every_connection_busy_a_new_one_is_refused_503():
    cap = 4
    with router(timeout_body_s=30, max_connections=cap) as (port, guard):
        busy = [connect(port) for _ in range(cap)]
        for sock in busy:  # each one inside a request (its body not complete): not evictable
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        wait_until(lambda: sum(c.phase.value == "body" for c in guard.open) == cap, 10, "requests under way")
        status_line = connect(port).recv(65536).split(b"\r\n", 1)[0]
        assert status_line == b"HTTP/1.1 503 Service Unavailable"
        assert guard.num_closed["refused"] == 1 and len(guard.open) == cap
        for sock in busy:
            sock.close()


def test_a_router_at_a_low_fd_limit_answers_under_thousands_of_idle_connections(tmp_path):
    """The fd limit (1,024) is far below the idle connections (4,000): without the cap the router's
    accept fails (asyncio logging a traceback per attempt), and every request with it."""
    (port,) = free_ports(1)
    deploy = DeploymentConfig.model_validate({"model": {"path": str(tmp_path), "served_name": "m"},
                                              "router": {"port": port, "ctx_urls": list(NO_WORKERS),
                                                         "gen_urls": list(NO_WORKERS)}})
    deploy.to_yaml(tmp_path / "d.yaml")
    log = tmp_path / "router.log"
    limit, num_idle = 1024, 4000

    def lower_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "router", "-c", str(tmp_path / "d.yaml")],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lower_fd_limit)
    socks: list[socket.socket] = []
    try:
        wait_until(lambda: _answers(port), 60, "the router")
        for _ in range(num_idle):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(5):
            assert get(port, "/ready")[0] == 503  # answered (no workers), not timed out
            assert get(port, "/health")[0] == 200
        closed = sample(port, r'helixserve_router_connections_closed_total\{reason="evicted"\}')
        assert closed >= num_idle - limit
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
    lines = log.read_text().splitlines()
    assert len(lines) < 50, lines[-20:]


def _answers(port: int) -> bool:
    try:
        return get(port, "/health")[0] == 200
    except OSError:
        return False
