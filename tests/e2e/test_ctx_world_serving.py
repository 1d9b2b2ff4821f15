"""``helixserve serve-ctx`` with ``ctx.tp: 2`` runs a ctx world (gloo, CPU): the server process is
rank 0 and spawns rank 1; it warms up, answers ``/ready``, and serves plain completions (prefill
and decode through the world) with the single-process worker's greedy tokens, leaving nothing
allocated. A killed rank fails the request in flight with a 503 ``ctx_world_failed`` naming it,
and the world restarts and serves again (the gen world's supervision, the same code).

It serves ``context_only`` to a gen world (dp 2 x cp 2) over real UCX: every ctx rank's KV sender
serves its own shard (on ``transceiver_port + rank``), the answer names them all
(``ctx_endpoints``, rank order) and each gen rank pulls from the ranks holding its part. Through
the router the greedy tokens equal the single-process worker's, for prompts around page
boundaries, on both DP groups. The gen worker dials only the deployment's transceivers (any of
``ctx_endpoints`` outside it: 403 naming it, nobody dialled), refuses a list that does not fit
the layout (400 naming ``ctx_endpoints``) and a layout that does not fit its own (400
``layout_mismatch`` naming the field and both values) or a ctx world size its heads do not split
over (400 naming ``layout.ctx_tp_size``). A hold the router releases, one whose client left, and
one no gen ever pulls are freed on every ctx rank. A ctx rank killed while the world holds one
request and streams another (the ctx ranks' sends held by a fault injector, ``held_sends_ctx``)
fails both, each with an error naming a ctx rank's endpoint, the streamed one at once (its
control connection closed, not at the transfer timeout); the world restarts and the next request
succeeds. After every case nothing is held or allocated on any ctx or gen rank."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import pytest

from tests.e2e.conftest import Deployment, http, wait_until
from tests.e2e.ctx_world import (PICKUP_S, TP, TPB, complete, complete_at_once, ctx_world_options, greedy_text,
                                 http_status, rank_used, request_body, seeded_prompt, wait_idle)
from tests.e2e.held_sends_ctx import HELD_SENDS_ENV, holding_pids, reached_file

# prompt lengths: one token, around a block (4) and the step budget (16), several chunks
LENGTHS = (1, 4, 5, 16, 17, 40)


@pytest.fixture(scope="module")
def dep_options() -> dict[str, Any]:
    return ctx_world_options(dp=2, cp=2)


@pytest.fixture(scope="module")
def world(dep_options, tmp_path_factory, dep_checkpoint):
    d = Deployment(tmp_path_factory.mktemp("ctx_world"), dep_checkpoint, **dep_options)
    d.held_sends = d.log_dir / "held_sends"  # while it exists, no ctx rank posts a shard message
    try:
        yield d.start_all(env={HELD_SENDS_ENV: str(d.held_sends)}, module="tests.e2e.held_sends_ctx")
    finally:
        d.stop()


def _prefill(d: Deployment, prompt: list[int]) -> dict:
    status, answer = complete(d.ctx_url, prompt, disaggregated_params={"request_type": "context_only"})
    assert status == 200 and answer["choices"][0]["finish_reason"] is None, answer
    return {**answer["disaggregated_params"], "request_type": "generation_only"}


def _decode(d: Deployment, params: dict, prompt: list[int]) -> tuple[int, dict]:
    return complete(d.gen_url, prompt, disaggregated_params=params)


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
        prompt = seeded_prompt(seed, n)
        got, want = complete(world.ctx_url, prompt), complete(world.baseline_url, prompt)
        assert got[0] == want[0] == 200, (got, want)
        assert (got[1]["choices"][0]["text"], got[1]["usage"]) == (want[1]["choices"][0]["text"], want[1]["usage"])
    wait_until(lambda: world.stats("ctx")["num_used_blocks"] == world.stats("ctx")["num_used_slots"] == 0,
               10, "the ctx world's caches freed", state=lambda: world.stats("ctx"))


def test_disaggregated_tokens_equal_the_single_process_workers_on_every_gen_group(world) -> None:
    params = _prefill(world, seeded_prompt(20, 9))
    ports = [world.config.ctx[0].transceiver_port + r for r in range(TP)]
    assert [e["port"] for e in params["ctx_endpoints"]] == ports and params["layout"]["ctx_tp_size"] == TP
    assert params["ctx_endpoint"] == params["ctx_endpoints"][0] and params["pull_grant"] is None
    status, answer = _decode(world, params, seeded_prompt(20, 9))
    want = greedy_text(world.baseline_url, seeded_prompt(20, 9))
    assert status == 200 and answer["choices"][0]["text"] == want, answer
    for n in (1, TPB, TPB + 1, 2 * TPB + 1, 17):  # around page boundaries; two at once: both DP groups
        prompts = [seeded_prompt(21 + n, n), seeded_prompt(41 + n, n)]
        got = complete_at_once(world.router_url, prompts)
        want = [greedy_text(world.baseline_url, p) for p in prompts]
        assert [answer["choices"][0]["text"] for _, answer in got] == want, (n, got)
    wait_idle(world)


def test_hostile_ctx_endpoints_and_mismatched_layouts_are_refused_naming_them(world) -> None:
    prompt = seeded_prompt(60, 6)
    params = _prefill(world, prompt)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        rogue = {"host": "127.0.0.1", "port": listener.getsockname()[1]}
        status, err = _decode(world, {**params, "ctx_endpoints": [params["ctx_endpoints"][0], rogue]}, prompt)
        assert status == 403 and err["error"]["code"] == "ctx_endpoint_not_allowed", err
        assert err["error"]["param"] == "disaggregated_params.ctx_endpoints[1]"
        assert f"127.0.0.1:{rogue['port']}" in err["error"]["message"]
        with pytest.raises(BlockingIOError):  # nobody dialled it
            listener.accept()
    for endpoints, named in (([params["ctx_endpoints"][0]], "names 1 ctx ranks"), ([], "names 0 ctx ranks"),
                             (params["ctx_endpoints"] * 2, "names 4 ctx ranks"),
                             (params["ctx_endpoints"][::-1], "ctx_endpoints[0]")):
        status, err = _decode(world, {**params, "ctx_endpoints": endpoints}, prompt)
        assert status == 400 and err["error"]["param"].endswith("ctx_endpoints"), err
        assert named in err["error"]["message"], err
    layout, endpoints = params["layout"], params["ctx_endpoints"]
    status, err = _decode(world, {**params, "layout": {**layout, "tokens_per_block": 2 * TPB}}, prompt)
    assert status == 400 and err["error"]["code"] == "layout_mismatch", err
    assert f"tokens_per_block: {TPB} != {2 * TPB}" in err["error"]["message"], err
    odd_world = {"layout": {**layout, "ctx_tp_size": 3}, "ctx_endpoints": [*endpoints, endpoints[0]]}
    status, err = _decode(world, {**params, **odd_world}, prompt)  # 4 KDA heads over 3 ctx ranks
    assert status == 400 and err["error"]["param"] == "disaggregated_params.layout.ctx_tp_size", err
    assert "num_kda_heads (4) must be divisible by ctx_tp_size (3)" in err["error"]["message"], err
    assert world.stats("gen")["num_live_requests"] == 0 and world.stats("gen")["num_used_blocks"] == 0
    status, answer = _decode(world, params, prompt)  # the ctx's own answer still decodes
    assert status == 200 and answer["choices"][0]["text"] == greedy_text(world.baseline_url, prompt), answer
    wait_idle(world)


def test_holds_released_aborted_or_never_pulled_are_freed_on_every_rank(world) -> None:
    released, aborted = _prefill(world, seeded_prompt(70, 9)), _prefill(world, seeded_prompt(72, 5))
    abandoned, held_at = _prefill(world, seeded_prompt(71, 13)), time.monotonic()
    assert world.stats("ctx")["kv_transfers_in_flight"] == 3 and any(rank_used(world.ctx_url))
    status, body = http("POST", f"{world.ctx_url}/v1/release", {"request_id": released["ctx_request_id"],
                                                                 "admission": released["ctx_admission"]})
    assert status == 200 and body["released"] is True, body
    status, body = http("POST", f"{world.ctx_url}/v1/abort", {"request_id": aborted["ctx_request_id"]})
    assert status == 200, body
    wait_until(lambda: world.stats("ctx")["kv_transfers_in_flight"] == 1, PICKUP_S - 1,
               "the released and the aborted hold freed on every rank before the pickup deadline",
               state=lambda: world.stats("ctx"))
    wait_idle(world, PICKUP_S + 10)  # the abandoned one at its hold deadline, on every rank
    assert time.monotonic() - held_at >= PICKUP_S - 1  # (not before it)
    status, err = _decode(world, abandoned, seeded_prompt(71, 13))  # too late: gone from every rank
    assert status in (503, 504) and "not held here" in err["error"]["message"], err
    wait_idle(world)


def test_a_killed_rank_fails_its_request_with_503_and_the_world_restarts(world) -> None:
    out: dict = {}
    body = request_body(seeded_prompt(11, 8), max_tokens=200)
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
    wait_until(lambda: http_status(f"{world.ctx_url}/health") == 200, 90, "the ctx world to restart",
               state=lambda: http("GET", f"{world.ctx_url}/health"))
    health = http("GET", f"{world.ctx_url}/health")[1]["world"]
    assert health["failure"] is None and rank1 not in health["rank_pids"] and health["restarts"] == 1
    prompt = seeded_prompt(12, 17)
    got, want = complete(world.ctx_url, prompt), complete(world.baseline_url, prompt)
    assert got[0] == 200 and got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
    wait_until(lambda: world.stats("ctx")["num_used_blocks"] == 0, 10, "nothing allocated after the restart")


def test_a_ctx_rank_killed_while_holding_or_streaming_fails_both_and_the_world_restarts(world) -> None:
    restarts = http("GET", f"{world.ctx_url}/health")[1]["world"]["restarts"]
    held, streamed = seeded_prompt(80, 11), seeded_prompt(82, 2 * TPB + 1)
    held_params, streamed_params = _prefill(world, held), _prefill(world, streamed)
    out: dict = {}
    world.held_sends.touch()
    try:
        thread = threading.Thread(target=lambda: out.update(answer=_decode(world, streamed_params, streamed)))
        thread.start()
        (rank1,) = http("GET", f"{world.ctx_url}/health")[1]["world"]["rank_pids"][1:]
        wait_until(lambda: holding_pids(world.held_sends) == {world.procs["ctx"].pid, rank1}, 30,
                   "both ctx ranks to hold their shard streams", state=lambda: holding_pids(world.held_sends))
        os.kill(rank1, signal.SIGKILL)
        thread.join(60)
    finally:
        world.held_sends.unlink()
        reached_file(world.held_sends).unlink(missing_ok=True)
    status, err = out["answer"]  # mid-stream: failed at once, not at the transfer timeout
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    # the world's failure also closes rank 0's sender: the gen names whichever ctx rank's
    # transfer failed first, the killed one or rank 0
    assert any(f":{e['port']}" in err["error"]["message"] for e in streamed_params["ctx_endpoints"]), err
    status, err = _decode(world, held_params, held)
    assert status in (503, 504) and err["error"]["code"] in ("kv_transfer_failed", "kv_transfer_timeout"), err
    assert any(f":{e['port']}" in err["error"]["message"] for e in held_params["ctx_endpoints"]), err
    wait_until(lambda: http_status(f"{world.ctx_url}/health") == http_status(f"{world.router_url}/ready") == 200,
               90, "the ctx world to restart and the router to see it",
               state=lambda: http("GET", f"{world.ctx_url}/health"))
    assert http("GET", f"{world.ctx_url}/health")[1]["world"]["restarts"] == restarts + 1
    prompt = seeded_prompt(81, 2 * TPB + 1)
    assert greedy_text(world.router_url, prompt) == greedy_text(world.baseline_url, prompt)
    wait_idle(world)
