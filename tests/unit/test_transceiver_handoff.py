"""Engine side of a transfer: a request started from a cache filled by someone else decodes exactly
like the engine that prefilled it (EngineCore.add_prefilled_request / Scheduler.add_prefilled)."""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.scheduler import Scheduler
from helixserve.kvcache.manager import CacheManager
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.presets import get_preset, init_random_weights

CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=4)
PROMPT = [5, 17, 3, 99, 250, 7, 7, 1, 42, 64, 128, 33, 2]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one torch thread is faster and does not suffer from a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["kimi-k3-tiny", "kimi-linear-tiny"])
def model(request):
    cfg = get_preset(request.param)
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, seed=3)
    return cfg, model.eval()


def _run(engine: EngineCore, request_id: str, updates: list) -> list[int]:
    """Step until idle; the tokens of `request_id`, starting with `updates`."""
    all_updates = list(updates)
    while engine.has_unfinished_requests():
        all_updates += engine.step()
    return [u.token_id for u in all_updates if u.request_id == request_id]


def _copy_request_cache(src: EngineCore, dst: EngineCore, src_id: str, dst_id: str, num_tokens: int) -> None:
    """What a transfer does: the destination allocates, and gets the source's bytes."""
    a, b = src.cache_manager.get(src_id), dst.cache_manager.allocate(dst_id, num_tokens)
    sc, dc = src.runner.caches, dst.runner.caches
    for layer, pool in sc.mla_kv.items():
        dc.mla_kv[layer][b.block_ids] = pool[a.block_ids[: len(b.block_ids)]]
    for pools, dpools in ((sc.kda_state, dc.kda_state), (sc.conv_state, dc.conv_state)):
        for layer, pool in pools.items():
            dpools[layer][b.slot] = pool[a.slot]


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                      SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_prefilled_request_decodes_like_the_prefilling_engine(model, sampling):
    cfg, net = model
    agg = EngineCore(net, cfg, None, CACHE)
    agg.add_request("agg", PROMPT, sampling)
    expected = _run(agg, "agg", [])
    assert len(expected) == 6

    ctx = EngineCore(net, cfg, None, CACHE)
    ctx.add_request("ctx", PROMPT, sampling.model_copy(update={"max_tokens": 1}), hold_cache=True)
    first = _run(ctx, "ctx", [])
    assert first == expected[:1] and ctx.stats().num_held == 1

    gen = EngineCore(net, cfg, None, CACHE)
    gen.add_request("warm", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0))
    gen.step()  # "warm" holds blocks and a slot now: the received request gets other ones
    _copy_request_cache(ctx, gen, "ctx", "gen", len(PROMPT))
    assert gen.cache_manager.get("gen").block_ids != ctx.cache_manager.get("ctx").block_ids
    assert gen.can_add_prefilled_request()
    updates = gen.add_prefilled_request("gen", PROMPT, first, sampling)
    assert [(u.token_id, u.status) for u in updates] == [(first[0], RequestStatus.RUNNING)]
    assert _run(gen, "gen", updates) == expected
    assert gen.stats().num_used_blocks == 0 and gen.stats().num_used_slots == 0
    ctx.release("ctx")
    assert ctx.stats().num_used_blocks == 0


def test_add_prefilled_refuses_without_cache_or_room():
    cache = CacheManager(num_blocks=8, num_slots=2, tokens_per_block=4)
    sched = Scheduler(cache, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="no cache handle"):
        sched.add_prefilled(Request("a", [1, 2, 3], params, forced_output_token_ids=[4]))
    cache.allocate("a", 3)
    with pytest.raises(ValueError, match="forced first token"):
        sched.add_prefilled(Request("a", [1, 2, 3], params))
    assert sched.add_prefilled(Request("a", [1, 2, 3], params, forced_output_token_ids=[4]))[0].token_id == 4
    cache.allocate("b", 3)
    assert not sched.can_add_prefilled()
    with pytest.raises(ValueError, match="running slots"):
        sched.add_prefilled(Request("b", [1, 2, 3], params, forced_output_token_ids=[4]))
    with pytest.raises(ValueError, match="already finished"):
        Scheduler(cache, 2, 16, 64).add_prefilled(
            Request("b", [1, 2, 3], SamplingParams(max_tokens=1), forced_output_token_ids=[4]))
