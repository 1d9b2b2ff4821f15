"""The HTTP guards every server installs, on a real uvicorn server on loopback: the body limit at
limit - 1 / limit / limit + 1 bytes (declared or chunked), and an unexpected exception that is a
500 with OpenAI's body on a keep-alive connection that stays usable."""

from __future__ import annotations

import http.client as httplib
import json
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from helixserve.serving.http import BodyLimit, InternalErrors, install_error_handlers
from helixserve.testing.servers import free_ports, wait_until

LIMIT = 4096


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    app.add_middleware(BodyLimit, max_body_bytes=LIMIT)
    app.add_middleware(InternalErrors)
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return JSONResponse({"num_bytes": len(await request.body())})

    @app.get("/boom")
    async def boom() -> Response:
        raise RuntimeError("injected fault")

    (port,) = free_ports(1)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 30, "uvicorn")
    yield port
    srv.should_exit = True
    thread.join(10)


def _post(port: int, body: bytes, chunked: bool) -> tuple[int, dict]:
    conn = httplib.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        if chunked:
            parts = (body[i:i + 1000] for i in range(0, len(body), 1000))
            conn.request("POST", "/echo", parts, encode_chunked=True)
        else:
            conn.request("POST", "/echo", body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_limit_minus_one_at_plus_one(server, chunked):
    for size in (LIMIT - 1, LIMIT):
        assert _post(server, b"x" * size, chunked) == (200, {"num_bytes": size})
    status, body = _post(server, b"x" * (LIMIT + 1), chunked)
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(LIMIT) in body["error"]["message"]


def test_an_unexpected_error_is_a_500_and_the_connection_stays_open(server):
    conn = httplib.HTTPConnection("127.0.0.1", server, timeout=30)
    try:
        conn.request("GET", "/boom")
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 500
        assert body["error"]["code"] == "internal_error"
        assert "injected fault" in body["error"]["message"]
        local = conn.sock.getsockname()
        conn.request("POST", "/echo", b"{}")
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())) == (200, {"num_bytes": 2})
        assert conn.sock.getsockname() == local
    finally:
        conn.close()
