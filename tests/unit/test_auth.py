"""Internal authentication: where the secret comes from (never the YAML, never a repr) and the
worker middleware's rules with a secret, without one, and with ``allow_unauthenticated``."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from helixserve.config import (INTERNAL_SECRET_ENV, INTERNAL_SECRET_FILE_ENV, DeploymentConfig, SecurityConfig,
                               child_environment, ensure_internal_secret, resolve_security)
from helixserve.serving.auth import INTERNAL_SECRET_HEADER, install_internal_auth

MODEL = {"path": "/nonexistent/model"}


def test_the_secret_comes_from_the_environment_or_a_file_and_is_never_written(tmp_path):
    deploy = DeploymentConfig(model=MODEL)
    assert resolve_security(deploy, {}).security.secret is None
    got = resolve_security(deploy, {INTERNAL_SECRET_ENV: " s3cret \n"})
    assert got.security.secret == "s3cret" and got.transceiver.secret == "s3cret"  # gRPC callers too
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    assert resolve_security(deploy, {INTERNAL_SECRET_FILE_ENV: str(secret_file)}).security.secret == "from-file"
    by_config = deploy.model_copy(update={"security": SecurityConfig(internal_secret_file=secret_file)})
    assert resolve_security(by_config, {}).security.secret == "from-file"
    assert resolve_security(by_config, {INTERNAL_SECRET_ENV: "env-wins"}).security.secret == "env-wins"
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_security(deploy, {INTERNAL_SECRET_FILE_ENV: str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="cannot read the internal secret file"):
        resolve_security(deploy, {INTERNAL_SECRET_FILE_ENV: str(tmp_path / "missing")})
    got.to_yaml(tmp_path / "deployment.yaml")
    assert "s3cret" not in (tmp_path / "deployment.yaml").read_text()
    assert "s3cret" not in repr(got) and "s3cret" not in str(got.security) and "s3cret" not in repr(got.transceiver)


def test_a_launcher_makes_a_fresh_secret_and_passes_it_by_environment_only(monkeypatch):
    monkeypatch.delenv(INTERNAL_SECRET_ENV, raising=False)
    monkeypatch.delenv(INTERNAL_SECRET_FILE_ENV, raising=False)
    first = ensure_internal_secret(DeploymentConfig(model=MODEL))
    second = ensure_internal_secret(DeploymentConfig(model=MODEL))
    assert first.security.secret and len(first.security.secret) >= 40
    assert first.security.secret != second.security.secret
    assert child_environment(first)[INTERNAL_SECRET_ENV] == first.security.secret
    monkeypatch.setenv(INTERNAL_SECRET_ENV, "operator-chosen")  # compose / SLURM job: kept
    assert ensure_internal_secret(DeploymentConfig(model=MODEL)).security.secret == "operator-chosen"


def _app(security: SecurityConfig) -> TestClient:
    app = FastAPI()
    install_internal_auth(app, security)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            return JSONResponse({"echo": json.loads(body)})
        except (ValueError, RecursionError):
            return JSONResponse({"raw_bytes": len(body)})  # a real worker's parser answers 400

    for path in ("/v1/abort", "/v1/release"):
        app.post(path)(lambda: JSONResponse({"ok": True}))
    for path in ("/health", "/metrics", "/stats", "/v1/prefix_events"):
        app.get(path)(lambda: JSONResponse({"ok": True}))
    return TestClient(app)


PLAIN = {"model": "m", "prompt": [1, 2]}
DISAGG = {**PLAIN, "disaggregated_params": {"request_type": "generation_only"}}


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_with_a_secret_every_route_but_health_and_metrics_needs_it():
    client = _app(SecurityConfig(internal_secret="s3cret"))
    for headers in ({}, {INTERNAL_SECRET_HEADER: "s3cre"}, {INTERNAL_SECRET_HEADER: "s3cret!"}):
        for path, body in (("/v1/completions", PLAIN), ("/v1/completions", DISAGG), ("/v1/abort", {}),
                           ("/v1/release", {})):
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401 and _error(response)["code"] == "invalid_internal_secret"
        assert client.get("/stats", headers=headers).status_code == 401
        assert client.get("/v1/prefix_events", headers=headers).status_code == 401
    assert client.get("/health").status_code == client.get("/metrics").status_code == 200
    # ... but a caller presenting a wrong secret (a misconfigured router) hears so there too
    assert client.get("/health", headers={INTERNAL_SECRET_HEADER: ""}).status_code == 401
    assert client.get("/metrics", headers={INTERNAL_SECRET_HEADER: "s3cre"}).status_code == 401
    assert client.get("/health", headers={INTERNAL_SECRET_HEADER: "s3cret"}).status_code == 200
    ok = {INTERNAL_SECRET_HEADER: "s3cret"}
    assert client.post("/v1/completions", json=DISAGG, headers=ok).json() == {"echo": DISAGG}
    assert client.post("/v1/abort", headers=ok).status_code == client.get("/stats", headers=ok).status_code == 200


def test_without_a_secret_internal_traffic_is_refused_unless_allowed():
    client = _app(SecurityConfig())
    assert client.post("/v1/completions", json=PLAIN).json() == {"echo": PLAIN}  # body replayed intact
    big = {**PLAIN, "prompt": list(range(200_000))}  # a body of several ASGI chunks
    assert client.post("/v1/completions", json=big).json() == {"echo": big}
    response = client.post("/v1/completions", json=DISAGG)
    assert response.status_code == 403
    error = _error(response)
    assert error["code"] == "permission_denied" and error["param"] == "disaggregated_params"
    assert "HELIXSERVE_INTERNAL_SECRET" in error["message"] and "allow_unauthenticated" in error["message"]
    for path in ("/v1/abort", "/v1/release"):
        assert client.post(path, json={}).status_code == 403
    assert client.get("/v1/prefix_events").status_code == 403  # the block keys a ctx worker caches
    for raw in (b"{not json", b"[" * 100_000):  # left to the route's own parser (it answers 400)
        assert client.post("/v1/completions", content=raw).json() == {"raw_bytes": len(raw)}
    assert client.post("/v1/completions", json={**PLAIN, "disaggregated_params": None}).status_code == 200
    assert client.get("/health", headers={INTERNAL_SECRET_HEADER: ""}).status_code == 200  # a router without one
    dev = _app(SecurityConfig(allow_unauthenticated=True))
    assert dev.post("/v1/completions", json=DISAGG).json() == {"echo": DISAGG}
    assert dev.post("/v1/abort", json={}).status_code == 200


def test_a_worker_refusing_the_routers_hop_is_a_503_for_the_client_not_a_4xx():
    """A real router app in front of a real (stand-in) worker on loopback that has no secret: the
    worker's 403 on the context_only hop reaches the client as 503 naming the worker and cause."""
    import threading
    import time

    import uvicorn

    from helixserve.config import RouterConfig
    from helixserve.router.app import build_router_app
    from helixserve.testing.servers import free_ports

    worker = FastAPI()
    install_internal_auth(worker, SecurityConfig())
    worker.get("/ready")(lambda: JSONResponse({"status": "ok"}))  # what the router's pools probe
    worker.post("/v1/completions")(lambda: JSONResponse({"never": "reached"}))
    port, = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(worker, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        router = build_router_app(RouterConfig(health_check_interval_s=0.05), (url,), (url,), "m",
                                  internal_secret="s3cret")
        with TestClient(router) as client:
            deadline = time.monotonic() + 10
            while client.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, client.get("/ready").json()
                time.sleep(0.05)
            response = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 503, response.json()
        error = _error(response)
        assert error["code"] == "ctx_worker_failed" and f"ctx worker {url} cannot serve this router" in error["message"]
        assert "answered 403" in error["message"] and "no internal secret" in error["message"]
    finally:
        server.should_exit = True
        thread.join(10)
