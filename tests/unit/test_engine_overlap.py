"""Overlapped decoding (``SchedulerConfig.overlap_decode``): the next decode step is enqueued before
the current one's tokens are read back, fed those tokens on the device. It must give exactly the
tokens of the plain engine, free every cache (late, never early), and stand aside whenever the
next step could differ from "every running request decodes once more"."""

from __future__ import annotations

import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import Request, SamplingParams
from helixserve.engine.scheduler import Scheduler
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import bytes_per_block, bytes_per_slot

PROMPTS = [[5, 6, 7], list(range(20, 57)), [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(100, 118))]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "kimi-k3-tiny"])
def pair(request, tiny_checkpoints):
    """(plain engine, overlapped engine) over the same checkpoint."""
    cache = CacheConfig(tokens_per_block=4, max_num_seqs=8)
    ckpt = tiny_checkpoints[request.param]
    return (LLM(ckpt, cache=cache, scheduler=SchedulerConfig(overlap_decode=False)),
            LLM(ckpt, cache=cache, scheduler=SchedulerConfig(overlap_decode=True)))


def count_ahead(llm: LLM) -> list[int]:
    """Wrap ``schedule_ahead`` to count the overlapped steps; returns the live counter."""
    sched, counter = llm.engine.scheduler, [0]
    original = type(sched).schedule_ahead

    def counting(self=sched):
        out = original(self)
        counter[0] += out is not None
        return out

    sched.schedule_ahead = counting
    return counter


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert (stats.num_used_blocks, stats.num_used_slots, stats.num_running) == (0, 0, 0)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.cache_manager.num_requests == 0


def test_overlapped_tokens_equal_plain_with_staggered_finishes(pair):
    plain, overlapped = pair
    ahead = count_ahead(overlapped)
    params = [greedy(n) for n in (6, 3, 11, 5)]  # finishes at different steps, mid-overlap
    ref = plain.generate(PROMPTS, params)
    got = overlapped.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.finish_reason for r in got] == ["length"] * 4
    assert ahead[0] >= 5  # the steady decode steps really overlapped
    assert_nothing_held(overlapped)


def test_overlapped_seeded_sampling_and_stop_tokens_equal_plain(pair):
    plain, overlapped = pair
    sampled = [SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=s, ignore_eos=True) for s in (1, 2)]
    ref = plain.generate(PROMPTS[:2], sampled)
    # stop on a token each request emits mid-way (taken from the plain run): a finish by stop rule
    # while the next step is already enqueued
    stops = [greedy(12, stop_token_ids=[t]) for t in (ref[0].token_ids[4], ref[1].token_ids[2])]
    stop_ref = plain.generate(PROMPTS[:2], [s.model_copy(update={"temperature": 0.9, "top_k": 40, "seed": i})
                                            for i, s in zip((1, 2), stops, strict=True)])
    params = sampled + [s.model_copy(update={"temperature": 0.9, "top_k": 40, "seed": i})
                        for i, s in zip((1, 2), stops, strict=True)]
    got = overlapped.generate(PROMPTS[:2] * 2, params)
    assert [r.token_ids for r in got[:2]] == [r.token_ids for r in ref]
    assert [r.token_ids for r in got[2:]] == [r.token_ids for r in stop_ref]
    assert [r.finish_reason for r in got[2:]] == ["stop", "stop"]
    assert [len(r.token_ids) for r in got[2:]] == [5, 3]
    assert_nothing_held(overlapped)


def test_abort_while_a_step_is_in_flight_frees_after_that_step(pair):
    """An aborted request's cache stays allocated while an enqueued step may still write it, and is
    freed when that step is read back; the other requests' tokens are unchanged."""
    plain, overlapped = pair
    ref = plain.generate(PROMPTS[:3], [greedy(10)] * 3)
    engine = overlapped.engine
    reqs = [engine.add_request(f"a{i}", p, greedy(10)) for i, p in enumerate(PROMPTS[:3])]
    while not (engine._in_flight is not None and reqs[1].num_output_tokens >= 3):  # noqa: SLF001
        engine.step()
    used = engine.stats().num_used_blocks
    assert engine.abort("a1")
    assert engine.stats().num_used_blocks == used  # deferred: the enqueued step holds a1's rows
    assert "a1" in engine.cache_manager
    updates = engine.step()
    assert "a1" not in engine.cache_manager and all(u.request_id != "a1" for u in updates)
    while engine.has_unfinished_requests():
        engine.step()
    assert reqs[0].output_token_ids == ref[0].token_ids and reqs[2].output_token_ids == ref[2].token_ids
    assert reqs[1].finish_reason == "abort"
    assert_nothing_held(overlapped)


def test_arrivals_and_max_model_len_step_aside(tiny_checkpoints):
    """New requests join through a plain step; a request at max_model_len is never run ahead."""
    ckpt = tiny_checkpoints["kimi-k3-tiny"]
    cache = CacheConfig(tokens_per_block=4, max_num_seqs=4, max_model_len=24)
    plain = LLM(ckpt, cache=cache, scheduler=SchedulerConfig(overlap_decode=False))
    overlapped = LLM(ckpt, cache=cache, scheduler=SchedulerConfig(overlap_decode=True))
    ref = plain.generate(PROMPTS[::2], [greedy(50), greedy(6)])
    assert ref[0].finish_reason == "length" and len(ref[0].token_ids) == 24 - len(PROMPTS[0])
    engine = overlapped.engine
    first = engine.add_request("x0", PROMPTS[0], greedy(50))
    for _ in range(4):
        engine.step()
    late = engine.add_request("x1", PROMPTS[2], greedy(6))  # arrives while x0's next step is enqueued
    while engine.has_unfinished_requests():
        engine.step()
    late_ref = plain.generate([PROMPTS[2]], greedy(6))[0]
    assert first.output_token_ids == ref[0].token_ids and late.output_token_ids == late_ref.token_ids
    assert_nothing_held(overlapped)


def test_a_cache_too_small_to_run_ahead_falls_back_to_plain_steps(tiny_checkpoints):
    """Under cache pressure nothing is preempted ahead of time: a step is enqueued ahead only when
    the cache covers every request's next token; plain steps preempt as usual; the tokens match."""
    ckpt = tiny_checkpoints["kimi-linear-tiny"]
    spec = cache_spec_for(LLM(ckpt).model_config, torch.float32, 4)
    budget = (3 * bytes_per_slot(spec) + 9 * bytes_per_block(spec)) / 2**20  # 3 slots, 9 blocks
    cache = CacheConfig(tokens_per_block=4, max_num_seqs=3, memory_budget_mib=budget)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0][::-1]]
    runs = []
    for overlap in (False, True):
        engine = LLM(ckpt, cache=cache, scheduler=SchedulerConfig(overlap_decode=overlap)).engine
        assert engine.layout.num_blocks == 9
        reqs = [engine.add_request(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats().num_used_blocks == 0
        runs.append(reqs)
    plain, overlapped = runs
    assert any(r.num_preemptions for r in plain)  # the pressure is real
    assert [r.output_token_ids for r in overlapped] == [r.output_token_ids for r in plain]
    assert all(len(r.output_token_ids) == 10 for r in overlapped)


def _scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(CacheManager(num_blocks, 8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40)


def _decoding(sched: Scheduler, *requests: Request) -> None:
    """Admit ``requests`` and run their prefill step."""
    for r in requests:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: 1 for s in out.seqs if s.sample})


def test_schedule_ahead_refuses_held_forced_and_unsampled_steps():
    sched = _scheduler()
    held = Request("h", [1, 2, 3], greedy(5), hold_cache_on_finish=True)
    _decoding(sched, held)
    sched.schedule()
    assert sched.schedule_ahead() is None  # a ctx prefill's cache must not see an extra step

    sched = _scheduler()
    forced = Request("f", [1, 2, 3], greedy(5), forced_output_token_ids=[7, 8, 9])
    _decoding(sched, forced)  # output 7 (forced); 8 and 9 still to come
    sched.schedule()
    assert sched.schedule_ahead() is None  # the next input would be a forced token, not the sample

    sched = Scheduler(CacheManager(64, 8, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=40)
    sched.add_request(Request("p", list(range(1, 12)), greedy(5)))
    out = sched.schedule()  # the prompt's first chunk (8 of 11 tokens): nothing sampled
    assert not out.seqs[0].sample and sched.schedule_ahead() is None


def test_schedule_ahead_follows_a_prompts_last_chunk_with_its_first_decode():
    sched = Scheduler(CacheManager(64, 8, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=40)
    sched.add_request(Request("p", list(range(1, 12)), greedy(5)))
    first = sched.schedule()
    sched.update_from_output(first, {})
    last = sched.schedule()  # the last chunk: tokens 8..10, sampled
    assert last.seqs[0].is_prefill and last.seqs[0].sample
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.seqs[0].context_len == 11  # the whole prompt, then the token
    assert sched.cache.get("p").num_tokens == 12
    sched.update_from_output(last, {"p": 50})
    sched.update_from_output(ahead, {"p": 51})
    request = sched.get_request("p")
    assert request.output_token_ids == [50, 51] and request.num_computed_tokens == 12
    assert sched.schedule().seqs[0].token_ids == [51]  # plain decoding goes on from there


def test_schedule_ahead_defers_the_frees_of_finished_requests():
    sched = _scheduler()
    a, b = Request("a", [1, 2, 3], greedy(2)), Request("b", [4, 5], greedy(6))
    _decoding(sched, a, b)
    out = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None and [s.token_ids for s in ahead.seqs] == [[-1], [-1]]
    assert [s.context_len for s in ahead.seqs] == [s.context_len + 1 for s in out.seqs]
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    assert sched.schedule_ahead() is None  # one step ahead at most
    updates = sched.update_from_output(out, {"a": 3, "b": 3})
    assert [u.is_finished for u in updates] == [True, False]  # a reached max_tokens = 2
    assert "a" in sched.cache  # a's row of the enqueued step may still be running
    updates = sched.update_from_output(ahead, {"a": 9, "b": 4})
    assert [u.request_id for u in updates] == ["b"]  # a's extra token is dropped
    assert "a" not in sched.cache and sched.cache.stats().num_requests == 1
    assert sched.get_request("b").output_token_ids == [1, 3, 4]


def test_a_failing_launch_ahead_fails_both_steps_requests(tiny_checkpoints, monkeypatch):
    """A step enqueued ahead failing as it launches (past its preparation's own errors): the step
    ends every request of both steps with an error update, drops both steps, frees every cache
    (deferred ones too), and the engine serves the next request."""
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=4),
              scheduler=SchedulerConfig(overlap_decode=True))
    engine, runner = llm.engine, llm.engine.runner
    real_prepare = runner.prepare_step
    ahead_calls = [0]

    def flaky(out, params, input_tokens=None):
        if input_tokens is not None:
            ahead_calls[0] += 1
            if ahead_calls[0] == 3:
                raise RuntimeError("kernel exploded")
        return real_prepare(out, params, input_tokens)

    monkeypatch.setattr(runner, "prepare_step", flaky)
    reqs = [engine.add_request(f"f{i}", p, greedy(8)) for i, p in enumerate(PROMPTS[:2])]
    failed = []
    while engine.has_unfinished_requests():
        failed += [u for u in engine.step() if u.error is not None]
    assert sorted(u.request_id for u in failed) == ["f0", "f1"]
    assert {u.error for u in failed} == {"engine step failed: RuntimeError: kernel exploded"}
    assert ahead_calls[0] == 3 and engine.abort_all("unused") == []
    assert all(r.finish_reason == "error" for r in reqs)
    assert_nothing_held(llm)
    monkeypatch.setattr(runner, "prepare_step", real_prepare)
    assert llm.generate([PROMPTS[2]], greedy(5))[0].token_ids == LLM(
        tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=4)
    ).generate([PROMPTS[2]], greedy(5))[0].token_ids


def test_a_full_server_with_a_queue_still_overlaps(pair):
    """Requests waiting for a sequence slot do not stop the overlap (a plain step could not admit
    them either); each is admitted a step after a slot frees, and every token matches."""
    plain, overlapped = pair
    params = [greedy(n) for n in (7, 4, 9, 5, 6, 3)]
    prompts = PROMPTS + PROMPTS[:2]
    runs = []
    for llm in (plain, overlapped):
        engine = llm.engine
        engine.scheduler.max_num_seqs = 2  # six requests through two slots: a queue all along
        ahead_with_queue = [0]
        original = type(engine.scheduler).schedule_ahead

        def counting(self=engine.scheduler, original=original, seen=ahead_with_queue):
            out = original(self)
            seen[0] += out is not None and bool(self.waiting)
            return out

        engine.scheduler.schedule_ahead = counting
        try:
            reqs = [engine.add_request(f"q{i}", p, pp) for i, (p, pp) in enumerate(zip(prompts, params, strict=True))]
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            engine.scheduler.max_num_seqs = 8
            del engine.scheduler.schedule_ahead
        runs.append(([r.output_token_ids for r in reqs], ahead_with_queue[0]))
    assert runs[1][0] == runs[0][0]
    assert runs[1][1] >= 5  # overlapped while others waited
    assert_nothing_held(overlapped)
