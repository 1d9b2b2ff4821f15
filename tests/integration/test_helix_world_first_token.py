"""A received request's first token in the SPMD generation world (gloo, a world of one): it
returns in the step the request starts, before any forward."""

from __future__ import annotations

from helixserve.engine.llm import LLM
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.world_llm import build_rank
from helixserve.launch.processes import run_local_world
from helixserve.parallel import Mapping, init_parallel
from tests.integration.test_helix_world import CACHE, KV_PARAMS, KV_PROMPTS, OPTIONS, PRESET, _FakeReceiver


def _first_token_world(rank: int, world_size: int, init_method: str, model_dir: str, first: int) -> list:
    mapping = Mapping(world_size, rank)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=OPTIONS.timeout_s)
    try:
        part = build_rank(model_dir, groups, OPTIONS, _FakeReceiver(model_dir, mapping))
        driver = WorldDriver(part, heartbeat_s=0.2)
        try:
            driver.add_request("kv", KV_PROMPTS[0], KV_PARAMS[0], forced_output_token_ids=[first],
                               kv_ticket=(KV_PROMPTS[0], None))
            steps = []
            while driver.has_unfinished_requests():
                forwards = part.executor.num_forwards
                tokens = [u.token_id for u in driver.step() if u.request_id == "kv"]
                steps.append((tokens, part.executor.num_forwards - forwards))
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
