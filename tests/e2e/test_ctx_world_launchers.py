"""A ctx world (``ctx.tp: 2``, gloo, CPU) started by the launchers: ``serve-ctx`` run as the
world's tasks (as srun runs it for the SLURM launcher: task 0 serves HTTP, task 1 is rank 1), under
torchrun, and
``helixserve launch`` with a ctx world and a recompute gen worker (the ctx worker spawns its rank;
the deployment comes up behind the router, and a request through it, the ctx world's
``context_only`` hop then gen, answers what the ctx world answers alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from helixserve.config import INTERNAL_SECRET_ENV, DeploymentConfig
from tests.e2e.conftest import MODEL, REPO, SECRET_HEADER, Deployment, free_ports, http, wait_until
from tests.e2e.ctx_world import TP, complete, http_status, request_body, seeded_prompt
from tests.e2e.test_launch import _descendants, _is_running


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, k3_tiny) -> Iterator[str]:
    """The URL of the single-process worker the ctx worlds answer as (a recompute gen worker), one
    for the module's worlds; started, not waited for (a test waits for it beside its world)."""
    d = Deployment(tmp_path_factory.mktemp("ctx_world_baseline"), k3_tiny, baseline_gen=True,
                   ctx={"tp": TP}, gen={"dp": 1, "cp": 1, "kv_source": "recompute"})
    try:
        d.start("baseline")
        yield d.baseline_url
    finally:
        d.stop()


def test_serve_ctx_as_srun_tasks_is_one_world(tmp_path, k3_tiny, baseline):
    """``srun -n 2 helixserve serve-ctx`` (SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR / MASTER_PORT as
    the SLURM launcher exports them): task 0 is rank 0 and serves, task 1 joins as rank 1 (no rank
    spawned); it answers as the single-process worker does, and a dead task makes the ctx worker
    exit non-zero (srun started the ranks: no restart in place)."""
    d = Deployment(tmp_path, k3_tiny, ctx={"tp": TP, "collective_timeout_s": 30},
                   gen={"dp": 1, "cp": 1, "kv_source": "recompute"})
    (master_port,) = free_ports(1)
    try:
        d.start_srun_tasks("ctx", TP, master_port)
        for url in (d.ctx_url, baseline):
            wait_until(lambda u=url: http_status(f"{u}/ready") == 200, 180, f"{url}/ready",
                       state=lambda: d.log("ctx-task0")[-800:])
        health = http("GET", f"{d.ctx_url}/health")[1]
        assert health["world"] == {"dp": 1, "cp": TP, "rank_pids": [None], "failure": None, "restarts": 0}
        for seed, n in enumerate((1, 5, 17)):
            got, want = complete(d.ctx_url, seeded_prompt(seed, n)), complete(baseline, seeded_prompt(seed, n))
            assert got[0] == want[0] == 200, (got, want)
            assert got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
        d.kill_task1_and_expect_task0_to_fail("ctx")
    finally:
        d.stop()


def test_serve_ctx_under_torchrun_is_one_world(tmp_path, k3_tiny, baseline):
    """``torchrun --nproc-per-node 2 -m helixserve.cli serve-ctx``: its agent serves the rendezvous
    store on MASTER_PORT; rank 0 serves (no rank spawned) and answers as the single-process worker."""
    d = Deployment(tmp_path, k3_tiny, ctx={"tp": TP, "collective_timeout_s": 30},
                   gen={"dp": 1, "cp": 1, "kv_source": "recompute"})
    (master_port,) = free_ports(1)
    try:
        with open(tmp_path / "ctx.log", "ab") as log:
            d.procs["ctx"] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP), "--master-addr",
                 "127.0.0.1", "--master-port", str(master_port), "-m", "helixserve.cli", "--log-level", "WARNING",
                 "serve-ctx", "-c", str(d.config_file)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=d.environment())
        torchrun = d.procs["ctx"]
        for url in (d.ctx_url, baseline):
            wait_until(lambda u=url: http_status(f"{u}/ready") == 200 or torchrun.poll() is not None, 180,
                       f"{url}/ready", state=lambda: d.log("ctx")[-800:])
        assert torchrun.poll() is None, d.log("ctx")
        health = http("GET", f"{d.ctx_url}/health")[1]
        assert health["world"] == {"dp": 1, "cp": TP, "rank_pids": [None], "failure": None, "restarts": 0}
        for seed, n in enumerate((1, 17)):
            got, want = complete(d.ctx_url, seeded_prompt(seed, n)), complete(baseline, seeded_prompt(seed, n))
            assert got[0] == want[0] == 200 and got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
    finally:
        d.stop()


def test_launch_brings_up_a_ctx_world_behind_the_router(tmp_path, k3_tiny):
    """``helixserve launch`` with ``ctx: [{tp: 2}]`` and a recompute gen worker: the ctx worker
    spawns its rank, the router gets ready; a request through the router (the ctx world's
    ``context_only`` hop, then gen) answers what the ctx world answers alone; SIGINT stops every
    process, the spawned rank too."""
    router_port, ctx_port, gen_port, tx_port = free_ports(4)
    secret = "s" * 48
    config = DeploymentConfig.model_validate({
        "model": {"path": str(k3_tiny), "served_name": MODEL},
        "cache": {"memory_budget_mib": 16, "max_num_seqs": 4},
        "ctx": [{"port": ctx_port, "transceiver_port": tx_port, "tp": TP, "collective_timeout_s": 30}],
        "gen": [{"port": gen_port, "dp": 1, "cp": 1, "kv_source": "recompute"}],
        "router": {"port": router_port, "health_check_interval_s": 0.25}})
    config.to_yaml(tmp_path / "local.yaml")
    log_path = tmp_path / "launch.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c", str(tmp_path / "local.yaml")],
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, INTERNAL_SECRET_ENV: secret})
    url = f"http://127.0.0.1:{router_port}"
    descendants: list[int] = []
    try:
        wait_until(lambda: "helixserve is ready" in log_path.read_text() or launcher.poll() is not None,
                   180, "launch to report ready", interval=0.3)
        assert launcher.poll() is None, log_path.read_text()
        descendants = _descendants(launcher.pid)
        world = http("GET", f"http://127.0.0.1:{ctx_port}/health")[1]["world"]
        assert world["cp"] == TP and len(world["rank_pids"]) == TP and world["rank_pids"][1] in descendants
        status, body = complete(url, seeded_prompt(0, 5))
        assert status == 200, body
        status, answer = http("POST", f"http://127.0.0.1:{ctx_port}/v1/completions",
                              request_body(seeded_prompt(0, 5)), headers={SECRET_HEADER: secret}, timeout=120)
        assert status == 200 and answer["usage"]["completion_tokens"] == 6, answer
        assert body["choices"][0]["text"] == answer["choices"][0]["text"], (body, answer)
    finally:
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
    wait_until(lambda: not [pid for pid in descendants if _is_running(pid)], 15, "every process to end")

