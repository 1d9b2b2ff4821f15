"""A request's failure is its own: a step that cannot be prepared for one request (its sampling,
its part of the batch) runs again without it, so every other request of the step finishes with
the tokens it gets alone, the failed one ends with an error naming the cause, and nothing of it
stays allocated. Faults: sampling parameters that passed no validation
(``SamplingParams.model_construct``), and an injected failure building one request's batch."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import helixserve.engine.runner as runner_module
from helixserve.config import CacheConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.llm import LLM
from helixserve.engine.request import INT32_MAX, Request, SamplingParams

PROMPTS = [[5, 6, 7], list(range(20, 47)), [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(100, 118))]
FAULT = "injected fault"


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=8))


def greedy(n: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


SEEDED = SamplingParams(max_tokens=5, temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
INNOCENTS = [(PROMPTS[0], greedy()), (PROMPTS[1], greedy(7)), (PROMPTS[2], SEEDED), (PROMPTS[3], greedy(3))]


def unvalidated(**fields: object) -> SamplingParams:
    """Sampling parameters no validator saw (what a caller bypassing them could bring)."""
    return SamplingParams.model_construct(**{**SamplingParams().model_dump(), "ignore_eos": True, **fields})


def alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params)[0].token_ids


def run(engine: EngineCore, batch: list[tuple[str, list[int], SamplingParams]], late: int = 0) -> dict[str, Request]:
    """Add ``batch`` (the last ``late`` requests once the others decode) and step to the end."""
    early = batch[:len(batch) - late]
    requests = {rid: engine.add_request(rid, prompt, p) for rid, prompt, p in early}
    if late:
        engine.step()
        engine.step()
        requests |= {rid: engine.add_request(rid, prompt, p) for rid, prompt, p in batch[len(early):]}
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def assert_only_culprit_failed(llm: LLM, requests: dict[str, Request], culprit: str, cause: str) -> None:
    failed = requests[culprit]
    assert failed.finish_reason == "error" and failed.output_token_ids == [], failed
    assert failed.error is not None and cause in failed.error, failed.error
    for i, (prompt, params) in enumerate(INNOCENTS):
        r = requests[f"innocent-{i}"]
        assert (r.error, r.finish_reason) == (None, "length"), r
        assert r.output_token_ids == alone(llm, prompt, params), r.request_id


@pytest.mark.parametrize("late", [0, 1], ids=["shared-prefill", "prefill-beside-decodes"])
@pytest.mark.parametrize(("fields", "cause"), [
    ({"temperature": 1.0, "seed": 2**70}, f"seed {2**70}"),
    ({"temperature": 1.0, "seed": -(2**63) - 1}, f"seed {-(2**63) - 1}"),
    ({"temperature": float("nan")}, "temperature nan is not a finite number"),
    ({"temperature": 0.5, "top_p": float("inf")}, "top_p inf is not a finite number"),
    ({"temperature": 0.5, "top_k": 2.5}, "top_k 2.5 does not fit an int64 row"),
], ids=["seed-2**70", "seed-below-int64", "temperature-nan", "top-p-inf", "top-k-float"])
def test_a_request_whose_sampling_cannot_be_set_up_fails_alone(llm, fields, cause, late):
    engine = llm.engine
    before = engine.cache_manager.stats()
    batch = [(f"innocent-{i}", prompt, p) for i, (prompt, p) in enumerate(INNOCENTS)]
    batch.insert(len(batch) - late, ("culprit", PROMPTS[1], unvalidated(max_tokens=4, **fields)))
    requests = run(engine, batch, late=late + 1 if late else 0)
    assert_only_culprit_failed(llm, requests, "culprit", cause)
    assert requests["culprit"].error.startswith("engine step failed: ")
    assert engine.cache_manager.stats() == before
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_a_top_k_past_int64_that_no_validator_saw_is_clamped_to_the_vocabulary(llm):
    """``top_k`` 2**63 keeps every token, as ``top_k`` = vocabulary size does."""
    vocab = llm.model_config.vocab_size
    huge = llm.generate([PROMPTS[1]], unvalidated(max_tokens=6, temperature=0.8, top_k=2**63, seed=3))[0]
    whole = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.8, top_k=vocab, seed=3,
                                                      ignore_eos=True))[0]
    assert huge.error is None and huge.token_ids == whole.token_ids


@pytest.mark.parametrize("late", [0, 1], ids=["shared-prefill", "prefill-beside-decodes"])
def test_a_batch_that_fails_to_build_runs_again_without_the_request_it_fails_for(llm, monkeypatch, late):
    """The failure names no request: each request's part is built alone; the one whose part
    fails alone ends with the error, the step runs without it."""
    build = runner_module.build_forward_batch
    calls = []

    def faulty(out, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a fault, injected
        calls.append(len(out.seqs))
        if any(s.request_id == "culprit" for s in out.seqs):
            raise RuntimeError(FAULT)
        return build(out, *args, **kwargs)

    engine = llm.engine
    before = engine.cache_manager.stats()
    batch = [(f"innocent-{i}", prompt, p) for i, (prompt, p) in enumerate(INNOCENTS)]
    batch.insert(len(batch) - late, ("culprit", PROMPTS[2], greedy(4)))
    monkeypatch.setattr(runner_module, "build_forward_batch", faulty)
    requests = run(engine, batch, late=late + 1 if late else 0)
    monkeypatch.undo()
    assert_only_culprit_failed(llm, requests, "culprit", f"engine step failed: RuntimeError: {FAULT}")
    assert 1 in calls  # parts built alone
    assert engine.cache_manager.stats() == before


def test_a_failure_no_request_explains_fails_its_step(llm, monkeypatch):
    """A batch that fails to build while each part builds alone: the step's requests end with
    the error (nothing ran), and the engine serves the next step."""
    build = runner_module.build_forward_batch

    def faulty(out, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(out.seqs) > 1:
            raise RuntimeError(FAULT)
        return build(out, *args, **kwargs)

    engine = llm.engine
    before = engine.cache_manager.stats()
    monkeypatch.setattr(runner_module, "build_forward_batch", faulty)
    requests = run(engine, [("a", PROMPTS[0], greedy()), ("b", PROMPTS[1], greedy())])
    monkeypatch.undo()
    for r in requests.values():
        assert r.finish_reason == "error" and r.error == f"engine step failed: RuntimeError: {FAULT}"
    assert engine.cache_manager.stats() == before
    assert llm.generate([PROMPTS[0]], greedy())[0].token_ids == alone(llm, PROMPTS[0], greedy())


# -- property: random parameters in mixed batches ---------------------------------------------

VOCAB = 512  # kimi-k3-tiny's; checked in the test
FIELDS = {  # field -> (valid values, invalid values)
    "temperature": (st.sampled_from([0.0, 0.0, 0.7, 1.0, 2.0]), st.sampled_from([float("nan"), float("inf"), -1.0])),
    "top_k": (st.sampled_from([-1, 0, 1, 7, VOCAB - 1, VOCAB, VOCAB + 1, INT32_MAX]),
              st.sampled_from([2**31, 2**63, -2])),
    "top_p": (st.sampled_from([1e-300, 0.5, 0.95, 1.0]), st.sampled_from([0.0, 1.5, float("nan")])),
    "seed": (st.integers(-(2**63), 2**64 - 1), st.sampled_from([2**64, -(2**63) - 1])),
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, 2**31])),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], dict[str, object], set[str], bool, bool]:
    """A prompt, its sampling fields, which of them are out of range, whether the fields reach
    the engine unvalidated, and whether it arrives once the others decode."""
    fields: dict[str, object] = {}
    invalid: set[str] = set()
    for name, (valid, bad) in FIELDS.items():
        if draw(st.integers(0, 9)) == 0:
            fields[name], _ = draw(bad), invalid.add(name)
        else:
            fields[name] = draw(valid)
    bypass = draw(st.booleans()) and "max_tokens" not in invalid
    return draw(st.sampled_from(PROMPTS)), fields, invalid, bypass, draw(st.booleans())


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(requests(), min_size=2, max_size=5))
def test_random_parameters_in_mixed_batches_fail_only_their_own_request(llm, batch):
    assert llm.model_config.vocab_size == VOCAB
    engine = llm.engine
    before = engine.cache_manager.stats()
    planned, refused = [], []
    for i, (prompt, fields, invalid, bypass, late) in enumerate(batch):
        if bypass:
            planned.append((late, (f"r{i}", prompt, unvalidated(**fields)), invalid))
            continue
        try:
            planned.append((late, (f"r{i}", prompt, SamplingParams(**fields, ignore_eos=True)), invalid))
        except ValidationError as err:
            refused.append((invalid, {e["loc"][0] for e in err.errors()}))
    for invalid, named in refused:  # refused at once, naming what is out of range
        assert invalid and named <= invalid, (invalid, named)
    ordered = sorted(planned, key=lambda x: x[0])  # the late ones last
    results = run(engine, [req for _, req, _ in ordered], late=sum(late for late, _, _ in ordered))
    for _, (rid, prompt, params), invalid in ordered:
        r = results[rid]
        if invalid:  # past no validator: it ends with an error naming the value, or runs harmlessly
            assert r.finish_reason == "length" or any(f"{name} " in (r.error or "") for name in invalid), r
        else:
            assert (r.error, r.finish_reason) == (None, "length"), r
            assert r.output_token_ids == alone_cached(llm, prompt, params), rid
    assert engine.cache_manager.stats() == before


_ALONE: dict[tuple[tuple[int, ...], str], list[int]] = {}


def alone_cached(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    key = (tuple(prompt), params.model_dump_json())
    if key not in _ALONE:
        _ALONE[key] = alone(llm, prompt, params)
    return _ALONE[key]
