"""``helixserve serve-ctx`` with ``ctx.tp: 2`` runs a ctx world (gloo, CPU): the server process is
rank 0 and spawns rank 1; it warms up, answers ``/ready``, and serves plain completions (prefill
and decode through the world) with the single-process worker's greedy tokens, leaving nothing
allocated. ``context_only`` is refused with a 400 naming tp (its KV cannot be sent from a world
yet), and a deployment whose gen workers pull KV over UCX makes it refuse to start, naming tp. A
killed rank fails the request in flight with a 503 ``ctx_world_failed`` naming it, and the world
restarts and serves again (the gen world's supervision, the same code)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from helixserve.config import RestartPolicy
from tests.e2e.conftest import MODEL, Deployment, http, wait_until

TP = 2
# prompt lengths: one token, around a block (4) and the step budget (16), several chunks
LENGTHS = (1, 4, 5, 16, 17, 40)


@pytest.fixture(scope="module")
def dep_options() -> dict[str, Any]:
    return {"baseline_gen": True, "ctx": {"tp": TP, "collective_timeout_s": 30,
                                          "world_restart": RestartPolicy(max_restarts=3, backoff_s=0.2)},
            "gen": {"dp": 1, "cp": 1, "kv_source": "recompute"},
            "scheduler": {"max_num_batched_tokens": 16}}


@pytest.fixture(scope="module")
def world(dep_options, tmp_path_factory, dep_checkpoint):
    d = Deployment(tmp_path_factory.mktemp("ctx_world"), dep_checkpoint, **dep_options)
    try:
        d.start("ctx")
        d.start("baseline")
        for url in (d.ctx_url, d.baseline_url):
            wait_until(lambda u=url: _status(f"{u}/ready") == 200, 180, f"{url}/ready",
                       state=lambda: (d.log("ctx")[-800:], d.log("baseline")[-400:]))
        yield d
    finally:
        d.stop()


def _status(url: str) -> int | None:
    try:
        return http("GET", url, timeout=5)[0]
    except OSError:
        return None


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(url: str, prompt: list[int], **extra: Any) -> tuple[int, dict]:
    return http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True, **extra}, timeout=120)


def test_the_ctx_world_is_rank_0_with_a_spawned_rank(world) -> None:
    status, health = http("GET", f"{world.ctx_url}/health")
    assert status == 200, health
    assert health["world"]["dp"] == 1 and health["world"]["cp"] == TP
    pids = health["world"]["rank_pids"]
    assert pids[0] is None and len(pids) == TP and all(isinstance(p, int) for p in pids[1:])
    assert health["world"]["failure"] is None
    gauges = [line for line in http("GET", f"{world.ctx_url}/metrics")[1].splitlines()
              if line.startswith("helixserve_worker_rank_cache_blocks_total{")]
    assert len(gauges) == TP and all('role="ctx"' in g for g in gauges), gauges


def test_plain_completions_equal_the_single_process_worker(world) -> None:
    for seed, n in enumerate(LENGTHS):
        prompt = _prompt(seed, n)
        got, want = _complete(world.ctx_url, prompt), _complete(world.baseline_url, prompt)
        assert got[0] == want[0] == 200, (got, want)
        assert (got[1]["choices"][0]["text"], got[1]["usage"]) == (want[1]["choices"][0]["text"], want[1]["usage"])
    wait_until(lambda: world.stats("ctx")["num_used_blocks"] == world.stats("ctx")["num_used_slots"] == 0,
               10, "the ctx world's caches freed", state=lambda: world.stats("ctx"))


def test_context_only_is_refused_naming_tp(world) -> None:
    status, body = _complete(world.ctx_url, _prompt(9, 5), disaggregated_params={"request_type": "context_only"})
    assert status == 400, body
    assert body["error"]["code"] == "ctx_world_transfer_unavailable"
    assert f"tp={TP}" in body["error"]["message"] and "not available yet" in body["error"]["message"]
    assert world.stats("ctx")["num_used_blocks"] == 0


def test_a_ctx_world_refuses_to_start_when_gen_pulls_its_kv(tmp_path, dep_checkpoint) -> None:
    d = Deployment(tmp_path, dep_checkpoint, ctx={"tp": TP})  # the default gen: kv_source ucx
    d.start("ctx")
    proc = d.procs["ctx"]
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert proc.returncode not in (None, 0), d.log("ctx")
        log = d.log("ctx")
        assert f"tp={TP}" in log and "not available yet" in log and "kv_source: ucx" in log, log
    finally:
        d.stop()


def test_a_killed_rank_fails_its_request_with_503_and_the_world_restarts(world) -> None:
    out: dict = {}
    body = {"model": MODEL, "prompt": _prompt(11, 8), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    thread = threading.Thread(target=lambda: out.update(
        answer=http("POST", f"{world.ctx_url}/v1/completions", body, timeout=120)))
    thread.start()
    wait_until(lambda: world.stats("ctx")["num_running"] >= 1, 60, "the request to decode on the ctx world")
    (rank1,) = http("GET", f"{world.ctx_url}/health")[1]["world"]["rank_pids"][1:]
    os.kill(rank1, signal.SIGKILL)
    thread.join(60)
    status, err = out["answer"]
    assert status == 503 and err["error"]["code"] == "ctx_world_failed", err
    assert f"ctx world rank 1 (pid {rank1})" in err["error"]["message"]
    wait_until(lambda: _status(f"{world.ctx_url}/health") == 200, 90, "the ctx world to restart",
               state=lambda: http("GET", f"{world.ctx_url}/health"))
    health = http("GET", f"{world.ctx_url}/health")[1]["world"]
    assert health["failure"] is None and rank1 not in health["rank_pids"] and health["restarts"] == 1
    prompt = _prompt(12, 17)
    got, want = _complete(world.ctx_url, prompt), _complete(world.baseline_url, prompt)
    assert got[0] == 200 and got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
    wait_until(lambda: world.stats("ctx")["num_used_blocks"] == 0, 10, "nothing allocated after the restart")
