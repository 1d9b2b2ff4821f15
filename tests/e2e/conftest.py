"""Real servers on loopback: each process started as ``python -m helixserve.cli <role>`` from a
deployment YAML with free ports, and stopped (process group) when its fixture ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from helixserve.config import DeploymentConfig

REPO = Path(__file__).resolve().parents[2]
MODEL = "kimi-k3-tiny"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(method: str, url: str, body: Any = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    """``(status, parsed JSON or text)``; never raises for an HTTP status."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def metric(url: str, name: str, default: float | None = None) -> float:
    """The sample ``name`` (with its labels, or the first labeled one) of a ``/metrics`` page."""
    _, text = http("GET", f"{url}/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(f"{name} not in {url}/metrics")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Deployment:
    """ctx + gen workers and a router as subprocesses, from one YAML."""

    def __init__(self, tmp: Path, model_dir: Path, **overrides: Any) -> None:
        ctx_port, gen_port, router_port, tx_port = free_ports(4)
        data: dict[str, Any] = {
            "model": {"path": str(model_dir), "served_name": MODEL},
            "cache": {"tokens_per_block": 4, "memory_budget_mib": 16, "max_num_seqs": 8,
                      "max_model_len": 256},
            "scheduler": {"max_num_batched_tokens": 512},
            "default_max_tokens": 16,
            "ctx": [{"port": ctx_port, "transceiver_port": tx_port, "pickup_timeout_s": 20}],
            "gen": [{"port": gen_port}],
            "router": {"port": router_port, "health_check_interval_s": 0.25,
                       "health_check_timeout_s": 1.0},
        }
        for key, value in overrides.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        self.config = DeploymentConfig.model_validate(data)
        self.config_file = tmp / "deployment.yaml"
        self.config.to_yaml(self.config_file)
        self.log_dir = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx_url, self.gen_url = self.config.ctx[0].url, self.config.gen[0].url
        self.router_url = f"http://127.0.0.1:{router_port}"

    def start(self, role: str, *extra: str) -> None:
        command = {"ctx": ["serve-ctx"], "gen": ["serve-gen"], "router": ["router"]}[role]
        log = open(self.log_dir / f"{role}.log", "ab")  # noqa: SIM115 (kept for the process)
        self.procs[role] = subprocess.Popen(
            [sys.executable, "-m", "helixserve.cli", "--log-level", "WARNING", *command,
             "-c", str(self.config_file), *extra],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_all(self) -> Deployment:
        for role in ("ctx", "gen", "router"):
            self.start(role)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{role} exited with {proc.returncode}:\n{self.log(role)}")
            try:
                return http("GET", f"{self.router_url}/ready", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(ready, timeout, "the router's /ready", interval=0.3)

    def log(self, role: str) -> str:
        path = self.log_dir / f"{role}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def kill(self, role: str, sig: signal.Signals = signal.SIGKILL) -> None:
        proc = self.procs.pop(role)
        os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self) -> None:
        for role in list(self.procs):
            self.kill(role, signal.SIGTERM)

    def stats(self, role: str) -> dict:
        url = {"ctx": self.ctx_url, "gen": self.gen_url}[role]
        return http("GET", f"{url}/stats")[1]

    def client(self, url: str | None = None, api_key: str = "none", timeout: float = 60):  # noqa: ANN201
        import openai

        return openai.OpenAI(base_url=f"{url or self.router_url}/v1", api_key=api_key,
                             max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def k3_tiny(tiny_checkpoints) -> Path:
    return tiny_checkpoints[MODEL]
