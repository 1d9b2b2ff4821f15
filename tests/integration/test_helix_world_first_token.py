"""Received requests in the SPMD generation world (gloo): the first token returns in the step the
request starts, before any forward (a world of one); a transfer's poll waits only when nothing else
would run (a CP group of two)."""

from __future__ import annotations

from helixserve.engine.llm import LLM
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.world_rank import build_rank, serve_rank
from helixserve.launch.processes import run_local_world
from helixserve.parallel import Mapping, init_parallel
from tests.integration.test_helix_world import (CACHE, KV_PARAMS, KV_PROMPTS, OPTIONS, PRESET, REQUESTS,
                                                _FakeReceiver, _ticket)


def _first_token_world(rank: int, world_size: int, init_method: str, model_dir: str, first: int) -> list:
    mapping = Mapping(world_size, rank)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=OPTIONS.timeout_s)
    try:
        part = build_rank(model_dir, groups, OPTIONS, _FakeReceiver(model_dir, mapping))
        driver = WorldDriver(part, heartbeat_s=0.2)
        try:
            driver.add_request("kv", KV_PROMPTS[0], KV_PARAMS[0], forced_output_token_ids=[first],
                               kv_ticket=_ticket(0, first))
            steps = []
            while driver.has_unfinished_requests():
                forwards = part.group.num_forwards
                tokens = [u.token_id for u in driver.step() if u.request_id == "kv"]
                steps.append((tokens, part.group.num_forwards - forwards))
            return steps
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def test_a_received_requests_first_token_comes_before_any_decode_step(tiny_checkpoints) -> None:
    """Alone in the world, a received request's first token (the ctx's) returns in the step it
    starts, with no forward (waiting for the decode step would add it to the time to first token);
    then one token per forward, and the single-process engine's answer."""
    model = str(tiny_checkpoints[PRESET])
    want = LLM(model, cache=CACHE).generate([KV_PROMPTS[0]], [KV_PARAMS[0]])[0].token_ids
    steps = run_local_world(_first_token_world, 1, model, want[0], timeout_s=120)[0]
    with_tokens = [step for step in steps if step[0]]
    assert with_tokens[0] == ([want[0]], 0)
    assert all(len(tokens) == 1 and forwards == 1 for tokens, forwards in with_tokens[1:])
    assert [t for tokens, _ in with_tokens for t in tokens] == want


def _poll_wait_world(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    mapping = Mapping(world_size, rank, dp=1, cp=2)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=OPTIONS.timeout_s)
    try:
        part = build_rank(model_dir, groups, OPTIONS, _FakeReceiver(model_dir, mapping))
        receiver = part.transfers.receiver
        if rank != 0:
            serve_rank(part)
            return {"waits": receiver.waits}
        driver = WorldDriver(part, heartbeat_s=0.2)
        try:
            driver.add_request("a", REQUESTS[0][0], REQUESTS[0][1])
            while not any(u.request_id == "a" for u in driver.step()):
                pass
            busy_from = len(receiver.waits)
            driver.add_request("kv", KV_PROMPTS[0], KV_PARAMS[0], forced_output_token_ids=[1],
                               kv_ticket=_ticket(0, 1))
            while not any(u.request_id == "kv" for u in driver.step()):
                pass
            busy_to = len(receiver.waits)
            while driver.has_unfinished_requests():
                driver.step()
            idle_from = len(receiver.waits)
            driver.add_request("kv2", KV_PROMPTS[1], KV_PARAMS[1], forced_output_token_ids=[1],
                               kv_ticket=_ticket(1, 1))
            while not any(u.request_id == "kv2" for u in driver.step()):
                pass
            idle_to = len(receiver.waits)
            while driver.has_unfinished_requests():
                driver.step()
            return {"waits": receiver.waits, "busy": (busy_from, busy_to), "idle": (idle_from, idle_to)}
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def test_a_transfer_poll_waits_only_when_nothing_else_would_run(tiny_checkpoints) -> None:
    """With a request decoding, every poll of a reception in flight is one non-blocking pass (a
    decode step never waits on a transfer); alone, the poll may wait for it. The follower's polls
    follow the leader's (one Transfers message per agreement)."""
    leader, follower = run_local_world(_poll_wait_world, 2, str(tiny_checkpoints[PRESET]), timeout_s=120)
    waits = leader["waits"]
    busy, idle = waits[slice(*leader["busy"])], waits[slice(*leader["idle"])]
    assert len(busy) >= 2 and not any(busy)  # the fake reports after two polls
    assert len(idle) >= 2 and all(idle)
    assert follower["waits"] == waits
