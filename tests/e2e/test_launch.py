"""``helixserve launch``: one command starts router + workers (the gen worker a dp 1 x cp 2 world,
its rank 1 a process of its own), answers, and stops with no orphans. And ``serve-gen`` started as
the world's tasks (as srun runs it for the SLURM launcher): task 0 serves, task 1 is rank 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helixserve.config import DeploymentConfig
from tests.e2e.conftest import MODEL, REPO, Deployment, free_ports, http, metric, wait_until


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


def _descendants(pid: int) -> list[int]:
    kids = _children(pid)
    return kids + [d for k in kids for d in _descendants(k)]


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


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
        assert answer["usage"]["prompt_tokens"] > 0
        children = _children(launcher.pid)
        assert len(children) == 3
        descendants = _descendants(launcher.pid)
        gen = next(c for c in children if "serve-gen" in Path(f"/proc/{c}/cmdline").read_text())
        assert http("GET", f"http://127.0.0.1:{gen_port}/health")[1]["world"]["cp"] == 2
        assert len(_descendants(gen)) >= 1  # the world's rank 1 (and its forkserver)
        # launch made one internal secret and gave it to every child by its environment only
        secrets = {_environ(c).get("HELIXSERVE_INTERNAL_SECRET") for c in children}
        assert len(secrets) == 1 and None not in secrets and len(next(iter(secrets))) >= 40
        assert all(next(iter(secrets)) not in Path(f"/proc/{c}/cmdline").read_text() for c in children)
        for port in (ctx_port, gen_port):  # the workers answer only the router
            assert http("GET", f"http://127.0.0.1:{port}/v1/models")[0] == 401
    finally:
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(60)
    assert code == 0
    assert "stopped" in (tmp_path / "launch.log").read_text()
    wait_until(lambda: not [pid for pid in descendants if _is_running(pid)], 10, "every process to end")
    assert os.path.isfile(model_dir / "config.json")


def test_serve_gen_as_srun_tasks_is_one_world(tmp_path, k3_tiny):
    """``srun -n 2 helixserve serve-gen`` (SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR / MASTER_PORT as
    the SLURM launcher exports them): task 0 is rank 0 and serves HTTP, task 1 joins as rank 1; the
    deployment answers as the local one does, and a dead task makes the gen worker exit non-zero."""
    d = Deployment(tmp_path, k3_tiny)
    (master_port,) = free_ports(1)
    try:
        d.start_srun_tasks("gen", 2, master_port)
        d.start("ctx")
        d.start("router")
        d.wait_ready()
        health = http("GET", f"{d.gen_url}/health")[1]
        assert health["world"] == {"dp": 1, "cp": 2, "rank_pids": [None], "failure": None, "restarts": 0}
        body = {"model": MODEL, "prompt": list(range(3, 20)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, disagg = http("POST", f"{d.router_url}/v1/completions", body)
        status_agg, agg = http("POST", f"{d.gen_url}/v1/completions", body)
        assert status == status_agg == 200 and disagg["choices"][0]["text"] == agg["choices"][0]["text"]
        assert metric(d.gen_url, "helixserve_worker_kv_transfers_completed_total") == 1
        d.kill_task1_and_expect_task0_to_fail("gen")
    finally:
        d.stop()


STOPS = 2  # the stop is a race between the worker's shutdown and its ranks: more than one in one test


def test_a_sigterm_stops_launch_cleanly_with_requests_in_flight(tmp_path, k3_tiny):
    """SIGTERM (what a process manager sends) after some requests, with a few more in flight:
    ``launch`` exits 0 and nothing logs an ERROR or a traceback (a gen world rank's exit during
    the stop is not a failure), every time."""
    router_port, ctx_port, gen_port, tx_port = free_ports(4)
    config = DeploymentConfig.model_validate({
        "model": {"path": str(k3_tiny), "served_name": MODEL},
        "cache": {"memory_budget_mib": 16, "max_num_seqs": 4},
        "ctx": [{"port": ctx_port, "transceiver_port": tx_port}], "gen": [{"port": gen_port}],
        "router": {"port": router_port, "health_check_interval_s": 0.25}})
    config.to_yaml(tmp_path / "local.yaml")
    url = f"http://127.0.0.1:{router_port}"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for attempt in range(STOPS):
        log_path = tmp_path / f"launch{attempt}.log"
        with open(log_path, "wb") as log:
            launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c",
                                         str(tmp_path / "local.yaml")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: "helixserve is ready" in log_path.read_text() or launcher.poll() is not None,
                       120, "launch to report ready", interval=0.3)
            for _ in range(2):
                assert http("POST", f"{url}/v1/completions", body)[0] == 200
            in_flight = [threading.Thread(target=http, args=("POST", f"{url}/v1/completions", body), daemon=True)
                         for _ in range(3)]
            for thread in in_flight:
                thread.start()
            wait_until(lambda: metric(f"http://127.0.0.1:{gen_port}", "helixserve_worker_requests_live") >= 1,
                       30, "a request to be in the gen worker", interval=0.02)
        finally:
            launcher.send_signal(signal.SIGTERM)
            code = launcher.wait(60)
        out = log_path.read_text()
        noisy = [line for line in out.splitlines() if "ERROR" in line or "Traceback" in line]
        assert code == 0 and not noisy, out[-4000:]
        assert "stopped" in out
