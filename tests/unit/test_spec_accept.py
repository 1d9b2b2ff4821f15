"""A verified run is appended and cut exactly as plain decoding (one token per step through the
real Scheduler) would have produced it: eos, ignore_eos, stop token ids, stop strings spanning the
run, max_tokens and max_model_len at +-1 of the run's end, forced output tokens."""

from __future__ import annotations

import pytest

from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.scheduler import Scheduler
from helixserve.engine.spec.accept import append_verified_tokens
from helixserve.engine.stop import stop_checker_for
from helixserve.kvcache import CacheManager

EOS = 1
PROMPT = [100, 101, 102]
MAX_MODEL_LEN = 12


def _detokenize(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _plain(params: SamplingParams, tokens: list[int], forced: list[int]) -> Request:
    """The request after plain decoding: one sampled token per scheduler step."""
    sched = Scheduler(CacheManager(64, 4, 4), 4, 64, MAX_MODEL_LEN, eos_token_ids=[EOS], detokenize=_detokenize)
    request = Request("r", list(PROMPT), params, forced_output_token_ids=list(forced))
    sched.add_request(request)
    stream = iter(tokens)
    while not request.is_finished:
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: next(stream) for s in out.seqs if s.sample})
    return request


def _speculative(params: SamplingParams, runs: list[list[int]], forced: list[int]) -> tuple[Request, list[int]]:
    request = Request("r", list(PROMPT), params, forced_output_token_ids=list(forced))
    checker = stop_checker_for("r", params.stop, _detokenize)
    appended = []
    for run in runs:
        result = append_verified_tokens(request, run, {EOS}, checker, MAX_MODEL_LEN)
        appended.append(result.num_appended)
        if result.status is not None:
            request.status = result.status
            break
    return request, appended


CASES = {
    "eos_mid_run": (SamplingParams(max_tokens=8), [[5, 6], [7, EOS, 9, 9]], [], [2, 2]),
    "eos_first": (SamplingParams(max_tokens=8), [[EOS, 4, 4]], [], [1]),
    "ignore_eos": (SamplingParams(max_tokens=4, ignore_eos=True), [[EOS, EOS], [EOS, EOS, EOS]], [], [2, 2]),
    "stop_id_last": (SamplingParams(max_tokens=8, stop_token_ids=(9,)), [[5, 6, 9]], [], [3]),
    "stop_string_across_runs": (SamplingParams(max_tokens=8, stop=("de",)), [[0, 2, 3], [4, 5, 6]], [], [3, 1]),
    "stop_string_in_one_run": (SamplingParams(max_tokens=8, stop=("cd",)), [[0, 2, 3, 4, 5]], [], [3]),
    "max_tokens_inside_run": (SamplingParams(max_tokens=3), [[5, 6, 7, 8]], [], [3]),
    "max_tokens_at_run_end": (SamplingParams(max_tokens=4), [[5, 6, 7, 8]], [], [4]),
    "max_tokens_one_past_run": (SamplingParams(max_tokens=5), [[5, 6, 7, 8], [9, 9]], [], [4, 1]),
    "max_model_len": (SamplingParams(max_tokens=50), [[5, 6, 7, 8], [5, 6, 7, 8, 9, 9]], [], [4, 5]),
    "forced_same": (SamplingParams(max_tokens=8), [[42, 6, EOS]], [42], [3]),
    "forced_differs": (SamplingParams(max_tokens=8), [[5, 6, 7], [8, EOS]], [42], [1, 2]),
}


@pytest.mark.parametrize("name", CASES)
def test_a_verified_run_is_cut_as_plain_decoding_cuts_it(name):
    params, runs, forced, num_appended = CASES[name]
    spec, appended = _speculative(params, runs, forced)
    assert appended == num_appended
    # plain decoding samples the same tokens, except that after a differing forced token the rest
    # of that run is never sampled: its next step samples the next run's tokens
    stream = [t for run, n in zip(runs, appended, strict=False) for t in run[:n]] + [EOS] * 20
    plain = _plain(params, stream, forced)
    assert spec.output_token_ids == plain.output_token_ids
    assert (spec.status, spec.stop_reason) == (plain.status, plain.stop_reason)
    assert spec.is_finished


def test_a_run_that_finishes_nothing_leaves_the_request_running():
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=8))
    result = append_verified_tokens(request, [4, 5, 6], {EOS}, None, MAX_MODEL_LEN)
    assert (result.num_appended, result.status) == (3, None)
    assert request.output_token_ids == [4, 5, 6] and request.status is RequestStatus.WAITING


def test_empty_runs_and_finished_requests_are_refused():
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="at least one token"):
        append_verified_tokens(request, [], {EOS}, None, MAX_MODEL_LEN)
    request.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="already finished_stopped"):
        append_verified_tokens(request, [4], {EOS}, None, MAX_MODEL_LEN)
