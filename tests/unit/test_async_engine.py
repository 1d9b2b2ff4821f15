"""AsyncEngine (thread-owned step loop) and the engine hooks the servers use: held caches,
forced first tokens, failing steps, bounded admission, shutdown; incremental detokenization."""

from __future__ import annotations

import asyncio

import pytest

from helixserve.config import CacheConfig
from helixserve.engine.async_engine import AsyncEngine, IncrementalDetokenizer
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.models.tokenizer_hf import build_byte_tokenizer
from helixserve.engine.errors import (EngineQueueFullError, EngineUnavailableError, RequestAbortedError,
                                      RequestRejectedError, StepFailedError)

PROMPT = list(range(30, 60))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=2))


def _decode(ids: list[int]) -> str:
    return build_byte_tokenizer().decode(ids, skip_special_tokens=True)


def _byte_ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: id == byte value


def test_detokenizer_never_emits_broken_utf8_and_adds_up():
    text = "héllo € 😀 ok"
    detok = IncrementalDetokenizer(_decode)
    ids = _byte_ids(text)
    deltas = [detok.add([t], is_finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[_byte_ids(text).index(0xF0)] == ""  # first byte of the emoji is held back


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_at_it():
    text = "abc STOP def"
    detok = IncrementalDetokenizer(_decode, stop=["STOP"])
    ids = _byte_ids(text)
    emitted = ""
    for i, t in enumerate(ids):
        emitted += detok.add([t], is_finished=False)
        assert "S" not in emitted  # never a prefix of the stop string that may complete
        if text[: i + 1].endswith("STOP"):
            emitted += detok.add([], is_finished=True)
            break
    assert emitted == "abc "


def test_detokenizer_flushes_invalid_bytes_at_the_end():
    detok = IncrementalDetokenizer(_decode)
    assert detok.add([0xE2, 0x82], is_finished=False) == ""
    assert detok.add([], is_finished=True) == _decode([0xE2, 0x82])


def test_core_holds_a_finished_cache_until_release(llm):
    core = llm.engine
    core.add_request("held", PROMPT, greedy(1), hold_cache=True)
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().num_held == 1 and core.stats().num_used_blocks == 8
    assert core.release("held") and not core.release("held")
    assert core.stats().num_used_blocks == 0
    core.add_request("held2", PROMPT, greedy(1), hold_cache=True)
    while core.has_unfinished_requests():
        core.step()
    assert core.abort("held2")  # cancel frees a held cache too
    assert core.stats().num_used_blocks == core.stats().num_held == 0


def test_forced_first_token_continues_like_the_sampled_one(llm):
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    ref = llm.generate([PROMPT], seeded)[0].token_ids
    core = llm.engine
    same = core.add_request("same", PROMPT, seeded, forced_output_token_ids=ref[:1])
    other = core.add_request("other", PROMPT, greedy(3), forced_output_token_ids=[5])
    while core.has_unfinished_requests():
        core.step()
    assert same.output_token_ids == ref
    assert other.output_token_ids[0] == 5
    with pytest.raises(ValueError, match="out of range"):
        core.add_request("bad", PROMPT, greedy(2), forced_output_token_ids=[10**6])


async def _collect(agen) -> tuple[list[int], str, str | None]:
    ids, text, reason = [], "", None
    async for out in agen:
        ids += out.token_ids
        text += out.text
        reason = out.finish_reason
    return ids, text, reason


def test_async_engine_matches_llm_and_frees_on_cancel(llm):
    ref = llm.generate([PROMPT], greedy(10))[0]

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer.decode, max_num_seqs=2, max_queue_len=1)
        engine.start()
        results = await asyncio.gather(*(_collect(engine.generate(f"r{i}", PROMPT, greedy(10)))
                                         for i in range(3)))
        assert all(r == (ref.token_ids, ref.text, "length") for r in results)
        agen = engine.generate("cancelled", PROMPT, greedy(200))
        await anext(agen)
        await agen.aclose()
        stream = engine.generate("aborted", PROMPT, greedy(200))
        await anext(stream)
        engine.abort("aborted")
        with pytest.raises(RequestAbortedError):
            await _collect(stream)
        with pytest.raises(RequestRejectedError, match="out of range"):
            await _collect(engine.generate("bad", [10**6], greedy(2)))
        await asyncio.sleep(0.7)  # the idle loop publishes fresh stats
        assert engine.stats().num_used_blocks == 0 and engine.num_live_requests == 0
        await engine.shutdown()

    asyncio.run(main())


def test_async_engine_bounds_admission(llm):
    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        live = [engine.generate(f"q{i}", PROMPT, greedy(50)) for i in range(3)]
        firsts = [asyncio.ensure_future(anext(g)) for g in live]
        await asyncio.sleep(0)
        with pytest.raises(EngineQueueFullError):
            await anext(engine.generate("one-too-many", PROMPT, greedy(2)))
        await asyncio.gather(*firsts)
        for g in live:
            await g.aclose()
        await engine.shutdown()

    asyncio.run(main())


def test_failing_step_fails_its_requests_and_the_loop_goes_on(llm, monkeypatch):
    runner = llm.engine.runner
    real_run = runner.run
    calls = {"n": 0}

    def flaky(prepared):  # noqa: ANN001, ANN202 - the model forward of a step
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel exploded")
        return real_run(prepared)

    monkeypatch.setattr(runner, "run", flaky)

    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=2)
        engine.start()
        with pytest.raises(StepFailedError, match="kernel exploded"):
            await _collect(engine.generate("victim", PROMPT, greedy(5)))
        ids, _, reason = await _collect(engine.generate("after", PROMPT, greedy(4)))
        assert len(ids) == 4 and reason == "length" and engine.num_step_errors == 1
        await asyncio.sleep(0.7)
        assert engine.stats().num_used_blocks == 0
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_live_requests_and_refuses_new_ones(llm):
    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=2)
        engine.start()
        stream = engine.generate("long", PROMPT, greedy(200))
        await anext(stream)
        await engine.shutdown(grace_s=0.0)
        with pytest.raises(EngineUnavailableError):
            await _collect(stream)
        with pytest.raises(EngineUnavailableError):
            await anext(engine.generate("late", PROMPT, greedy(2)))
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.stats().num_used_blocks == 0

    asyncio.run(main())


def test_call_runs_on_the_engine_thread_and_reports_errors(llm):
    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        async for _ in engine.generate("h", PROMPT, greedy(1), hold_cache=True):
            pass
        handle = await engine.call(lambda core: core.cache_manager.get("h"))
        assert handle.slot is not None and len(handle.block_ids) == 8
        with pytest.raises(Exception, match="holds no cache handle"):
            await engine.call(lambda core: core.cache_manager.get("nobody"))
        assert await engine.release("h")
        await engine.shutdown()

    asyncio.run(main())


def test_a_start_function_replaces_add_request(llm):
    ref = llm.generate([PROMPT], greedy(6))[0].token_ids

    def start(core):
        request = core.add_request("started", PROMPT, greedy(6), forced_output_token_ids=ref[:1])
        assert request.request_id == "started"
        return None

    def refuse(core):
        raise ValueError("no cache handle for this request")

    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        ids, _, reason = await _collect(engine.generate("started", PROMPT, greedy(6), start=start))
        assert ids == ref and reason == "length"
        with pytest.raises(RequestRejectedError, match="no cache handle"):
            await _collect(engine.generate("refused", PROMPT, greedy(6), start=refuse))
        await engine.shutdown()

    asyncio.run(main())
