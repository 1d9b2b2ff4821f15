"""Overload and a dead ctx are answered at once, not at a timeout.

- The router learns each worker's admission capacity (its ``/ready`` answer) and never forwards
  more than that: a burst beyond it is queued in the router (bounded) or answered 429 with
  ``Retry-After`` by the router itself, while the ctx is frozen and could answer nothing.
- A ctx worker killed while a gen world waits in the middle of its shard stream (the ctx's sends
  held by a fault injector, ``held_sends_ctx``) fails the request on every CP rank as soon as the
  control connection to it closes, long before ``kv_transfer_timeout_ms``, and frees every block.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import MODEL, Deployment, http, metric, wait_until
from tests.e2e.held_sends_ctx import HELD_SENDS_ENV, reached_file

TRANSFER_TIMEOUT_S = 10.0
# the dead ctx's request must end well inside its transfer timeout (the control connection closes
# with the process; the rest is the CP group's agreement and the answer)
DEAD_CTX_BOUND_S = 3.0
CTX_RUNNING_SLOTS = 8  # the Deployment's cache.max_num_seqs
ROUTER_QUEUE = 4
BURST = 24
# a generous bound: the router's 429s arrive while the ctx is frozen, or not at all
ROUTER_ANSWER_BOUND_S = 10.0


@pytest.fixture(scope="module")
def dep(tmp_path_factory, k3_tiny):
    tmp = tmp_path_factory.mktemp("fail_fast")
    d = Deployment(tmp, k3_tiny,
                   transceiver={"kv_transfer_timeout_ms": TRANSFER_TIMEOUT_S * 1000,
                                "rpc_timeout_ms": 5000, "drain_timeout_ms": 2000},
                   router={"max_queue_len": ROUTER_QUEUE, "health_check_timeout_s": 5.0})
    # the ctx admits its running slots and nothing more (max_queue_len 0): capacity 8 < 128
    d.config = d.config.model_copy(update={"ctx": [d.config.ctx[0].model_copy(update={"max_queue_len": 0})]})
    d.save()
    d.held_sends = tmp / "held_sends"
    try:
        yield d.start_all(env={HELD_SENDS_ENV: str(d.held_sends)}, module="tests.e2e.held_sends_ctx")
    finally:
        d.stop()


async def _burst(dep: Deployment, num: int) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """``num`` requests at once through the router while the ctx is frozen: returns once the
    router answered everything it does not forward (or after the bound), then thaws the ctx and
    collects the rest."""
    ctx_pid = dep.procs["ctx"].pid
    limits = httpx.Limits(max_connections=num + 4)
    async with httpx.AsyncClient(base_url=dep.router_url, limits=limits, timeout=60) as client:
        body = {"model": MODEL, "prompt": "ping", "max_tokens": 4, "temperature": 0}
        os.killpg(ctx_pid, signal.SIGSTOP)
        try:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(num)]
            num_refused = num - CTX_RUNNING_SLOTS - ROUTER_QUEUE
            deadline = time.monotonic() + ROUTER_ANSWER_BOUND_S
            while sum(t.done() for t in tasks) < num_refused and time.monotonic() < deadline:
                await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            answered_frozen = [t.result() for t in tasks if t.done()]
        finally:
            os.killpg(ctx_pid, signal.SIGCONT)
        rest = await asyncio.gather(*(t for t in tasks if not t.done()))
    return answered_frozen, list(rest)


def _ctx_requests(dep: Deployment, status: str) -> float:
    return metric(dep.ctx_url, f'helixserve_worker_requests_total{{role="ctx",status="{status}"}}', default=0.0)


def test_router_answers_overload_itself_and_never_overfills_a_worker(dep):
    assert http("GET", f"{dep.ctx_url}/ready")[1]["capacity"] == CTX_RUNNING_SLOTS
    served_before = _ctx_requests(dep, "200")
    answered_frozen, rest = asyncio.run(_burst(dep, BURST))
    # the router refused the excess while the ctx could not answer anything: from its own queue
    num_refused = BURST - CTX_RUNNING_SLOTS - ROUTER_QUEUE
    assert len(answered_frozen) == num_refused, [r.status_code for r in answered_frozen]
    for response in answered_frozen:
        assert response.status_code == 429 and response.headers["retry-after"] == "1", response.text
        error = response.json()["error"]
        assert error["code"] == "queue_full" and "the router is at capacity" in error["message"], error
    # what it forwarded (its slots, then its queue) was served: no worker refused anything
    assert [r.status_code for r in rest] == [200] * (CTX_RUNNING_SLOTS + ROUTER_QUEUE), [r.text for r in rest]
    assert _ctx_requests(dep, "200") == served_before + len(rest)  # (the counter read below is live)
    for url, role in ((dep.ctx_url, "ctx"), (dep.gen_url, "gen")):
        refused = metric(url, f'helixserve_worker_requests_total{{role="{role}",status="429"}}', default=0.0)
        assert refused == 0, f"{role} worker refused {refused} requests the router forwarded"
    wait_until(dep.is_idle, 10, "nothing allocated on ctx and gen")


def test_ctx_killed_mid_transfer_fails_it_on_every_rank_at_once(dep):
    params = dep.prefill_on_ctx(list(range(40, 75)))
    dep.held_sends.touch()  # the ctx accepts the shard requests and sends nothing
    out: dict = {}

    def decode() -> None:
        out["answer"] = http("POST", f"{dep.gen_url}/v1/completions", {
            "model": MODEL, "prompt": "ignored", "max_tokens": 8, "temperature": 0,
            "disaggregated_params": params}, timeout=60)
        out["ended_at"] = time.monotonic()

    thread = threading.Thread(target=decode)
    thread.start()
    wait_until(reached_file(dep.held_sends).exists, 15, "the ctx holding an accepted shard stream")
    assert dep.stats("gen")["num_used_blocks"] > 0
    killed_at = time.monotonic()
    dep.kill("ctx")
    thread.join(TRANSFER_TIMEOUT_S + 10)
    status, err = out["answer"]
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    endpoint = f"{params['ctx_endpoint']['host']}:{params['ctx_endpoint']['port']}"
    assert f"ctx worker {endpoint} went away" in err["error"]["message"], err
    assert out["ended_at"] - killed_at < DEAD_CTX_BOUND_S < TRANSFER_TIMEOUT_S
    gen = dep.stats("gen")
    assert gen["num_used_blocks"] == gen["num_used_slots"] == gen["num_live_requests"] == 0, gen
