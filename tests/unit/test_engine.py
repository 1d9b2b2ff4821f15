"""Single-process engine: continuous batching gives each request the tokens it gets alone."""

from __future__ import annotations

import pytest

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams

PROMPTS = [[5, 6, 7], list(range(20, 57)), [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(100, 118))]


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "kimi-k3-tiny"])
def llm(request, tiny_checkpoints):
    return LLM(tiny_checkpoints[request.param], cache=CacheConfig(tokens_per_block=8, max_num_seqs=8))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_batch_of_mixed_lengths_equals_each_alone(llm):
    params = [greedy(n) for n in (6, 3, 9, 5)]
    together = llm.generate(PROMPTS, params)
    for prompt, p, res in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], p)[0]
        assert res.token_ids == alone.token_ids
        assert len(res.token_ids) == p.max_tokens and res.finish_reason == "length"


def test_chunked_prefill_and_staggered_arrivals_give_the_same_tokens(llm, tiny_checkpoints):
    """A small token budget splits prompts into chunks and makes prefills join running decodes."""
    ref = llm.generate(PROMPTS, greedy(7))
    small = LLM(
        llm.model_dir,
        cache=CacheConfig(tokens_per_block=4, max_num_seqs=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=9),
    )
    engine = small.engine
    reqs = [engine.add_request("r0", PROMPTS[0], greedy(7))]
    engine.step()
    engine.step()  # r0 decoding when the others arrive
    reqs += [engine.add_request(f"r{i}", p, greedy(7)) for i, p in enumerate(PROMPTS[1:], 1)]
    saw_mixed = False
    while engine.has_unfinished_requests():
        out_before = engine.scheduler.num_waiting
        engine.step()
        saw_mixed |= out_before > 0 and reqs[0].num_output_tokens > 1
    assert saw_mixed
    assert [r.output_token_ids for r in reqs] == [r.token_ids for r in ref]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].token_ids
    batched = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [greedy(4), p, SamplingParams(max_tokens=5, seed=9)])
    assert batched[1].token_ids == alone
    other_seed = llm.generate([PROMPTS[1]], p.model_copy(update={"seed": 4321}))[0].token_ids
    assert other_seed != alone


def test_stop_token_and_stop_string(llm):
    first = llm.generate([PROMPTS[1]], greedy(6))[0]
    stop_tok = first.token_ids[2]
    res = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_tok,)))[0]
    assert res.token_ids == first.token_ids[: first.token_ids.index(stop_tok) + 1]
    assert res.finish_reason == "stop"
    text = first.text
    if len(text) >= 2:
        stop_str = text[1:2]
        res = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.0, stop=(stop_str,)))[0]
        assert res.finish_reason == "stop" and stop_str not in res.text


def test_text_prompt_and_bad_inputs(llm):
    res = llm.generate(["Hello, helix"], greedy(3))[0]
    assert res.prompt_token_ids == list(b"Hello, helix")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], greedy(2))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**6]], greedy(2))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert llm.engine.cache_manager.stats().num_requests == 0


def test_cache_is_empty_after_generate(llm):
    llm.generate(PROMPTS, greedy(4))
    stats = llm.engine.cache_manager.stats()
    assert stats.num_requests == 0 and stats.num_used_blocks == 0 and stats.num_used_slots == 0


def test_decode_step_runs_in_slot_order_and_returns_logits_in_scheduled_order(llm):
    """A decode step whose slots are a consecutive range in another order runs with the sequences
    sorted by slot (the state rows are one slice of the pools) and returns each sequence's logits in
    the scheduled order: the same logits as the step scheduled in slot order."""
    import torch

    from helixserve.engine.runner import slot_order
    from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput

    runner = llm.engine.runner
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    slots = [2, 0, 1]
    block_tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(3)]

    def step(seqs: list[ScheduledSeq]) -> torch.Tensor:
        return runner.forward(SchedulerOutput(seqs=seqs))

    def prefill() -> None:
        step([ScheduledSeq(f"r{i}", p, 0, block_tables[i], slots[i], True, True) for i, p in enumerate(prompts)])

    decode = [ScheduledSeq(f"r{i}", [7 + i], len(p), block_tables[i], slots[i], False, True)
              for i, p in enumerate(prompts)]
    assert slot_order(SchedulerOutput(seqs=decode)) == [1, 2, 0]
    seen = []
    forward = runner.model.forward
    runner.model.forward = lambda batch, caches: seen.append(batch.state_slots.tolist()) or forward(batch, caches)
    try:
        prefill()
        permuted = step(decode)
        prefill()
        in_slot_order = step([decode[i] for i in (1, 2, 0)])
    finally:
        del runner.model.forward
    assert seen[1] == seen[3] == [0, 1, 2]
    torch.testing.assert_close(permuted[[1, 2, 0]], in_slot_order, rtol=1e-5, atol=1e-5)
    assert slot_order(SchedulerOutput(seqs=[decode[i] for i in (1, 2, 0)])) is None  # already ascending
    assert slot_order(SchedulerOutput(seqs=decode[:1] + decode[2:])) == [1, 0]  # slots 2, 1
    assert slot_order(SchedulerOutput(seqs=decode[:2])) is None  # slots 2, 0: not a consecutive range


def test_a_prefill_the_decode_graphs_decline_zeroes_each_fresh_slot_once(llm, monkeypatch):
    """With decode graphs captured, a step they do not take (a prefill) runs eagerly; its fresh
    state slots are zeroed once before the model runs, not once by the graph path and again by
    the eager one (each zeroing moved the slot index to the device), and the logits are the
    eager path's."""
    import torch

    from helixserve.engine import runner as runner_module
    from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput

    runner = llm.engine.runner
    zeroed: list[list[int]] = []
    real_reset = runner_module.reset_slots
    monkeypatch.setattr(runner_module, "reset_slots",
                        lambda caches, ids: zeroed.append(list(ids)) or real_reset(caches, ids))

    class Declining:  # stands in for DecodeGraphs on a step they do not cover
        def fits(self, out):
            return False

        def run(self, out, input_tokens):
            return None

    pages = [-(-len(p) // runner.caches.tokens_per_block) for p in PROMPTS[:2]]
    out = SchedulerOutput(seqs=[ScheduledSeq("a", PROMPTS[0], 0, list(range(pages[0])), 3, True, True),
                                ScheduledSeq("b", PROMPTS[1], 0, list(range(pages[0], sum(pages))), 1, True, True)])
    eager = runner.forward(out)
    assert zeroed == [[3, 1]]
    zeroed.clear()
    monkeypatch.setattr(runner, "decode_graphs", Declining())
    declined = runner.forward(out)
    assert zeroed == [[3, 1]]
    torch.testing.assert_close(declined, eager, rtol=0, atol=0)
