"""``helixserve launch``: one command starts router + workers, answers, and stops with no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from pathlib import Path

from helixserve.config import DeploymentConfig
from tests.e2e.conftest import MODEL, REPO, free_ports, http, wait_until

pytest.importorskip("fastapi", reason="server deps (fastapi, uvicorn, httpx, prometheus-client) not installed")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_launch_makes_the_tiny_model_serves_and_stops_everything(tmp_path):
    router_port, ctx_port, gen_port, tx_port = free_ports(4)
    model_dir = tmp_path / "kimi-k3-tiny"  # missing: launch makes it (named after a preset)
    config = DeploymentConfig.model_validate({
        "model": {"path": str(model_dir), "served_name": MODEL},
        "cache": {"memory_budget_mib": 16, "max_num_seqs": 4},
        "ctx": [{"port": ctx_port, "transceiver_port": tx_port}], "gen": [{"port": gen_port}],
        "router": {"port": router_port, "health_check_interval_s": 0.25}})
    config_file = tmp_path / "local.yaml"
    config.to_yaml(config_file)
    log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115
    launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c",
                                 str(config_file), "--port", str(router_port)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router_port}"
    try:
        wait_until(lambda: "helixserve is ready" in (tmp_path / "launch.log").read_text()
                   or launcher.poll() is not None, 120, "launch to report ready", interval=0.3)
        out = (tmp_path / "launch.log").read_text()
        assert launcher.poll() is None, out
        assert f"{url}/v1/completions" in out and "curl" in out
        status, answer = http("POST", f"{url}/v1/completions",
                              {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        children = _children(launcher.pid)
        assert len(children) == 3
        grandchildren = [g for c in children for g in _children(c)]
    finally:
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(60)
    assert code == 0
    assert "stopped" in (tmp_path / "launch.log").read_text()
    assert not [pid for pid in children + grandchildren if _is_running(pid)]
    assert os.path.isfile(model_dir / "config.json")
