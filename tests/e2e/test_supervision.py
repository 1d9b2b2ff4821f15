"""Supervision: a gen world whose rank dies fails its in-flight requests with 503
``gen_world_failed`` (streamed or not), stops exporting the dead world's gauges, restarts itself
and serves again; past its restart policy the gen worker exits non-zero. ``helixserve launch``
starts a child that died again (bounded), and stops everything once a child exceeds it."""

from __future__ import annotations

import http.client as httplib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from helixserve.config import DeploymentConfig, RestartPolicy
from tests.e2e.conftest import MODEL, REPO, Deployment, free_ports, http, metric, wait_until

RESTART_BOUND_S = 90  # a restarted tiny world: spawn, rendezvous, load (slow on a loaded CI box)
FAIL_BOUND_S = 10


# conftest: one deployment for these modules (this one last: it kills gen world ranks, and the
# group's gen world restarts up to 5 times, 0.2 s apart)
SHARED_DEPLOYMENT = "disagg"


def _long_body(stream: bool, chat: bool = False) -> dict:
    body = {"model": MODEL, "max_tokens": 230, "temperature": 0, "ignore_eos": True, "stream": stream}
    return {**body, "messages": [{"role": "user", "content": "go"}]} if chat else {**body, "prompt": "go"}


def _decoding(dep: Deployment) -> bool:
    return dep.stats("gen")["num_running"] >= 1


def _rank_gauges(url: str) -> list[str]:
    text = http("GET", f"{url}/metrics")[1]
    return [line for line in text.splitlines() if line.startswith("helixserve_worker_rank_cache_blocks_used{")]


def _kill_rank1(dep: Deployment) -> int:
    (rank1,) = dep.rank_pids()
    os.kill(rank1, signal.SIGKILL)
    return rank1


def _comes_back(dep: Deployment, dead_pid: int) -> None:
    """The gen worker restarts its world (new rank pids), the router routes to it again."""
    wait_until(lambda: http("GET", f"{dep.gen_url}/health")[0] == 200, RESTART_BOUND_S,
               "the gen world to restart", state=lambda: http("GET", f"{dep.gen_url}/health"))
    health = http("GET", f"{dep.gen_url}/health")[1]
    assert health["world"]["failure"] is None and dead_pid not in health["world"]["rank_pids"]
    assert health["world"]["restarts"] >= 1
    dep.wait_ready()
    status, answer = http("POST", f"{dep.router_url}/v1/completions",
                          {"model": MODEL, "prompt": "ping", "max_tokens": 3, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    assert len(_rank_gauges(dep.gen_url)) == 2  # both ranks of the new world, labelled again
    wait_until(dep.is_idle, 10, "nothing allocated after the restart")


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_rank_killed_during_a_non_streamed_request_is_503_then_world_restarts(dep, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(
        answer=http("POST", f"{dep.router_url}{path}", _long_body(False, chat), timeout=60)))
    thread.start()
    wait_until(lambda: _decoding(dep), 60, "the request to decode on gen")
    assert metric(dep.gen_url, "helixserve_worker_cache_blocks_used") > 0
    began = time.monotonic()
    dead = _kill_rank1(dep)
    thread.join(FAIL_BOUND_S + 30)
    status, err = out["answer"]
    assert status == 503, err
    assert err["error"]["code"] == "gen_world_failed" and err["error"]["type"] == "service_unavailable_error"
    assert f"rank 1 (pid {dead})" in err["error"]["message"]
    assert time.monotonic() - began < FAIL_BOUND_S
    # the dead world's cache is not exported as if it were live (today: its blocks stay "used")
    wait_until(lambda: metric(dep.gen_url, "helixserve_worker_cache_blocks_used") == 0, 3,
               "the dead world's used blocks to be dropped",
               state=lambda: (_rank_gauges(dep.gen_url), http("GET", f"{dep.gen_url}/health")))
    _comes_back(dep, dead)


def test_rank_killed_during_a_stream_ends_it_with_a_503_error_event_then_world_restarts(dep):
    parsed = urlparse(dep.router_url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(_long_body(True)), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    events: list[str] = []

    def read_events() -> None:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])

    reader = threading.Thread(target=read_events)
    reader.start()
    wait_until(lambda: len(events) >= 2, 60, "the stream's first tokens")
    dead = _kill_rank1(dep)
    reader.join(FAIL_BOUND_S + 30)
    assert not reader.is_alive(), "the stream did not end"
    conn.close()
    last = json.loads(events[-1])  # the error event is the last one: no [DONE] after it
    assert last["error"]["code"] == "gen_world_failed", events[-3:]
    assert f"rank 1 (pid {dead})" in last["error"]["message"]
    assert all("error" not in json.loads(e) for e in events[:-1])
    wait_until(lambda: not _rank_gauges(dep.gen_url) or http("GET", f"{dep.gen_url}/health")[0] == 200, 3,
               "the dead world's rank gauges to be dropped")
    _comes_back(dep, dead)


def test_requests_while_the_world_restarts_get_503_naming_it(dep):
    dead = _kill_rank1(dep)
    wait_until(lambda: http("GET", f"{dep.gen_url}/health")[0] == 503, 5, "gen to notice the dead rank")
    status, err = http("POST", f"{dep.gen_url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 503 and err["error"]["code"] in ("gen_world_failed", "gen_worker_failed"), err
    assert "gen world" in err["error"]["message"]
    _comes_back(dep, dead)


def test_gen_worker_exits_nonzero_once_its_restarts_are_spent(tmp_path, k3_tiny):
    d = Deployment(tmp_path, k3_tiny)
    gen = d.config.gen[0].model_copy(update={"world_restart": RestartPolicy(max_restarts=0)})
    d.config = d.config.model_copy(update={"gen": [gen]})
    d.save()
    try:
        d.start("gen")
        wait_until(lambda: _up(f"{d.gen_url}/ready"), 120, "the gen worker", interval=0.3)
        _kill_rank1(d)
        assert d.procs["gen"].wait(60) == 1
        assert "not restarted" in d.log("gen") and "max_restarts=0" in d.log("gen")
        d.procs.pop("gen")
    finally:
        d.stop()


def _up(url: str) -> bool:
    try:
        return http("GET", url, timeout=2)[0] == 200
    except OSError:
        return False


# ---------------------------------------------------------------- helixserve launch


def _child_of(launcher: subprocess.Popen, command: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher.pid and command in cmdline:
            return int(entry.name)
    return None


def test_launch_restarts_a_killed_ctx_then_stops_once_it_exceeds_its_restarts(tmp_path, k3_tiny):
    router_port, ctx_port, gen_port, tx_port = free_ports(4)
    config = DeploymentConfig.model_validate({
        "model": {"path": str(k3_tiny), "served_name": MODEL},
        "cache": {"memory_budget_mib": 16, "max_num_seqs": 4},
        "ctx": [{"port": ctx_port, "transceiver_port": tx_port}], "gen": [{"port": gen_port}],
        "router": {"port": router_port, "health_check_interval_s": 0.25},
        "launch": {"restart": {"max_restarts": 1, "backoff_s": 0.1}}})
    config_file = tmp_path / "local.yaml"
    config.to_yaml(config_file)
    log_path = tmp_path / "launch.log"
    launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c", str(config_file)],
                                cwd=REPO, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{router_port}"
    try:
        wait_until(lambda: "helixserve is ready" in log_path.read_text() or launcher.poll() is not None,
                   120, "launch to report ready", interval=0.3)
        assert launcher.poll() is None, log_path.read_text()
        ctx = _child_of(launcher, "serve-ctx")
        assert ctx is not None
        os.killpg(ctx, signal.SIGKILL)
        wait_until(lambda: http("GET", f"{url}/ready")[0] == 503, 10, "the router to see the ctx gone")
        wait_until(lambda: http("GET", f"{url}/ready")[0] == 200 or launcher.poll() is not None, 120,
                   "launch to restart the ctx worker", interval=0.3)
        assert launcher.poll() is None, log_path.read_text()
        assert "restarting" in log_path.read_text()
        new_ctx = _child_of(launcher, "serve-ctx")
        assert new_ctx not in (None, ctx)
        status, answer = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        # a second death within the window exceeds max_restarts=1: launch stops everything, exit 1
        os.killpg(new_ctx, signal.SIGKILL)
        code = launcher.wait(60)
        assert code == 1, log_path.read_text()
        assert "exceeded" in log_path.read_text()
        assert not _up(f"http://127.0.0.1:{gen_port}/health") and not _up(f"{url}/ready")
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(60)
