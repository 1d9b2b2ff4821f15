"""Speculative decoding in the single-process engine: greedy speculative decoding gives plain
decoding's tokens (n-gram drafts, and scripted drafts that force long accepted runs and
rejections at chosen positions), at prompt and output lengths crossing pages, with stop rules
cutting inside an accepted run; a rejection leaves the KDA state and the cache pages where plain
decoding has them."""

from __future__ import annotations

import pytest

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.testing.drafts import ScriptedDrafter, run_mixed

TPB = 4  # small pages: prompts, drafts and runs cross them
PROMPTS = [list(range(20, 57)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
           [7] * 10, [3, 4] * 7]
NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_llm(ckpt, speculative=NGRAM, **sched) -> LLM:
    return LLM(ckpt, cache=CacheConfig(tokens_per_block=TPB, max_num_seqs=8),
               scheduler=SchedulerConfig(**sched), speculative=speculative)


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "kimi-k3-tiny"])
def ckpt(request, tiny_checkpoints):
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def plain(ckpt):
    return make_llm(ckpt, speculative=None)


def scripted(ckpt, plain_llm, prompts, params, k, wrong=frozenset(), **sched) -> tuple[LLM, list]:
    ref = plain_llm.generate(prompts, params)
    llm = make_llm(ckpt, **sched)
    llm.engine.scheduler.drafter = ScriptedDrafter(k, {tuple(p): r.token_ids for p, r in zip(prompts, ref)}, wrong)
    return llm, ref


def test_greedy_ngram_speculation_equals_plain_decoding(ckpt, plain):
    params = [greedy(n) for n in (33, 17, 40, 25, 9)]
    ref = plain.generate(PROMPTS, params)
    llm = make_llm(ckpt)
    got = llm.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections were rolled back
    assert llm.engine.cache_manager.stats().num_used_blocks == 0


def test_overlapped_decoding_with_ngram_speculation_equals_plain_decoding(ckpt, plain):
    """Decode steps run ahead while no request would draft; drafted steps run after the pending
    token, so speculation with overlapped decoding gives plain decoding's tokens."""
    params = [greedy(n) for n in (33, 17, 40, 25, 9)]
    ref = plain.generate(PROMPTS, params)
    llm = make_llm(ckpt, overlap_decode=True)
    assert llm.engine.overlap_decode
    scheduler, ahead = llm.engine.scheduler, []
    schedule_ahead = scheduler.schedule_ahead

    def counted():
        out = schedule_ahead()
        ahead.append(out is not None)
        return out

    scheduler.schedule_ahead = counted
    got = llm.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert any(ahead) and not all(ahead) and llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.cache_manager.stats().num_used_blocks == 0


@pytest.mark.parametrize("k,wrong", [(7, set()), (4, {2}), (3, {0}), (5, {4})])
def test_scripted_accepted_runs_and_rejections_equal_plain(ckpt, plain, k, wrong):
    params = greedy(29)
    llm, ref = scripted(ckpt, plain, PROMPTS[:3], params, k, wrong)
    got = llm.generate(PROMPTS[:3], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    stats = llm.engine.spec_stats
    first_wrong = min(wrong, default=k)
    assert stats.num_drafts > 0 and max(len(stats.accepted_per_position), 1) <= k
    assert stats.accepted_per_position[first_wrong:] == [0] * (len(stats.accepted_per_position) - first_wrong)
    if first_wrong:
        assert stats.accepted_per_position[first_wrong - 1] == stats.num_drafts - _capped(stats, first_wrong)


def _capped(stats, n):
    """Verified runs that had fewer than ``n`` drafts (near max_tokens) can not accept ``n``."""
    return stats.num_drafts - stats.accepted_per_position[n - 1]


def _run_steps(llm, prompt, params):
    engine = llm.engine
    request = engine.add_request("r", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append([u.token_id for u in engine.step() if u.request_id == "r"])
    return request, steps


def test_stop_token_and_stop_string_cut_inside_an_accepted_run(ckpt, plain):
    prompt, k = PROMPTS[0], 4
    ref = plain.generate([prompt], greedy(30))[0].token_ids
    # runs of k + 1 after the first token: outputs 1..5, 6..10, ...; index 8 sits inside the second
    index = next(i for i in range(7, 20) if ref[i] not in ref[:i] and i % (k + 1) not in (0, 1))
    for stop in ({"stop_token_ids": (ref[index],)}, {"stop": (plain.tokenizer.decode([ref[index]]),)}):
        if "stop" in stop and stop["stop"][0] in plain.tokenizer.decode(ref[:index]):
            continue  # the string appears earlier: not a cut inside this run
        params = greedy(30, **stop)
        want = plain.generate([prompt], params)[0]
        llm, _ = scripted(ckpt, plain, [prompt], greedy(30), k)
        request, steps = _run_steps(llm, prompt, params)
        assert request.output_token_ids == want.token_ids and request.finish_reason == want.finish_reason == "stop"
        assert len(steps[-1]) < k + 1 and llm.engine.spec_stats.accepted_per_position[-1] > 0


def _step_to(llm, prompt, params, num_outputs):
    engine = llm.engine
    request = engine.add_request("r", prompt, params)
    while request.num_output_tokens < num_outputs:
        engine.step()
    return request


def _kda_diff(llm, plain_llm) -> float:
    """Largest difference of the request's KDA recurrent and conv states between two engines."""
    caches, plain_caches = llm.engine.caches, plain_llm.engine.caches
    slot, plain_slot = llm.engine.cache_manager.get("r").slot, plain_llm.engine.cache_manager.get("r").slot
    diffs = [(pool[layer][slot].float() - plain_pool[layer][plain_slot].float()).abs().max().item()
             for pool, plain_pool in ((caches.kda_state, plain_caches.kda_state),
                                      (caches.conv_state, plain_caches.conv_state)) for layer in pool]
    return max(diffs)


@pytest.mark.parametrize("wrong", [{0}, {1}, {2}])
def test_kda_state_after_a_rejection_matches_plain_decoding(ckpt, plain, wrong, monkeypatch):
    """After a verify step that rejected draft ``j`` the slot's recurrent and conv state are
    plain decoding's at the same position. Not byte-equal: the rollback replays plain decoding's
    kernels (conv step, recurrent step) on the verify forward's projections, and a projection
    GEMM over ``n + 1`` rows rounds differently from one over one row (as do the layers below),
    so the states agree to fp32 rounding (1e-5). Without the rollback they are far apart."""
    prompt, params = PROMPTS[0], greedy(12)
    plain_llm = make_llm(ckpt, speculative=None)
    plain_request = _step_to(plain_llm, prompt, params, min(wrong) + 2)
    llm, ref = scripted(ckpt, plain, [prompt], params, 3, wrong)
    request = _step_to(llm, prompt, params, 2)  # prefill, then one verify step with a rejection
    assert llm.engine.spec_stats.num_drafts == 1
    assert request.output_token_ids == plain_request.output_token_ids == ref[0].token_ids[:min(wrong) + 2]
    assert request.num_computed_tokens == plain_request.num_computed_tokens
    assert _kda_diff(llm, plain_llm) < 1e-5
    assert llm.engine.cache_manager.stats().num_used_blocks == plain_llm.engine.cache_manager.stats().num_used_blocks
    no_rollback, _ = scripted(ckpt, plain, [prompt], params, 3, wrong)
    monkeypatch.setattr(no_rollback.engine.runner, "rollback", lambda record, keep: None)
    _step_to(no_rollback, prompt, params, 2)
    assert _kda_diff(no_rollback, plain_llm) > 1e-2


def test_prefill_chunks_beside_verify_rows_and_seeded_requests(ckpt, plain):
    """A small budget puts prompt chunks beside verify rows in one step; a seeded sampled
    request's tokens do not depend on its batch under speculation."""
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=77, ignore_eos=True)
    params = [greedy(21), seeded, greedy(14), greedy(18), greedy(11)]
    ref = plain.generate(PROMPTS, params)
    llm, _ = scripted(ckpt, plain, PROMPTS, params, 3, {1}, max_num_batched_tokens=12)
    reqs, mixed = run_mixed(llm.engine, ("a", PROMPTS[0], params[0]),
                            [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(PROMPTS[1:], params[1:]), 1)])
    assert mixed
    greedy_ids = [0, 2, 3, 4]
    assert [reqs[i].output_token_ids for i in greedy_ids] == [ref[i].token_ids for i in greedy_ids]
    alone_llm, _ = scripted(ckpt, plain, [PROMPTS[1]], seeded, 3, {1})  # the same drafts
    alone = alone_llm.generate([PROMPTS[1]], seeded)[0].token_ids
    assert reqs[1].output_token_ids == alone and len(alone) == 20
