"""N-gram prompt lookup: longest suffix first, latest occurrence, cut at the sequence's end; a
batched proposer with per-sequence caps; long sequences; no torch."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.request import Request, SamplingParams
from helixserve.engine.spec.drafting import NgramDrafter, last_token_recurs
from helixserve.engine.spec.ngram import NgramProposer, propose_one


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force over every n and every start, straight from the definition."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            i = starts[-1]
            return tokens[i + n:i + n + k]
    return []


def test_match_proposes_what_followed():
    #        0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert propose_one(tokens, 3, 1, 3) == [4, 5, 9]


def test_the_most_recent_occurrence_wins():
    tokens = [7, 8, 1, 7, 8, 2, 0, 7, 8]
    assert propose_one(tokens, 1, 2, 2) == [2]


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # suffix [4, 5] occurs at 1 (followed by 6); suffix [5] alone occurs later at 5 (followed by 0)
    tokens = [3, 4, 5, 6, 1, 5, 0, 4, 5]
    assert propose_one(tokens, 1, 1, 2) == [6]
    assert propose_one(tokens, 1, 1, 1) == [0]


def test_no_match_proposes_nothing():
    assert propose_one([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_one([1, 2, 3, 1, 9], 3, 2, 3) == []  # [1, 9] never occurred before


@pytest.mark.parametrize("tokens", [[], [5], [5, 6]])
def test_a_sequence_no_longer_than_the_pattern(tokens):
    assert propose_one(tokens, 4, 2, 4) == []
    assert propose_one([5, 5], 4, 1, 4) == [5]  # n = 1 fits: the earlier 5 is followed by a 5


def test_a_match_just_before_the_suffix_proposes_the_suffix():
    # [2, 3] at 2..3 directly followed by the suffix [2, 3] itself (occurrences may overlap)
    tokens = [0, 1, 2, 3, 2, 3]
    assert propose_one(tokens, 5, 2, 2) == [2, 3]


def test_k_larger_than_what_follows_is_cut_at_the_end():
    tokens = [1, 2, 3, 8, 1, 2]
    assert propose_one(tokens, 7, 2, 2) == [3, 8, 1, 2]
    assert propose_one(tokens, 2, 2, 2) == [3, 8]


def test_a_repeated_token_run_takes_its_latest_occurrence():
    # [4, 4, 4]'s latest earlier start is 6, followed by one token only
    assert propose_one([4] * 10, 3, 1, 3) == [4]


def test_random_sequences_agree_with_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        tokens = rng.integers(0, 4, n).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 8))
        assert propose_one(tokens, k, lo, hi) == _reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_the_drafter_drafts_what_prompt_lookup_finds():
    """The scheduler's drafter skips the lookup when the last token is new; its drafts are the
    brute-force lookup's either way (both ways taken here)."""
    rng = np.random.default_rng(1)
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_draft_tokens=4, prompt_lookup_min=1,
                                             prompt_lookup_max=3), max_model_len=10**6)
    num_skipped = 0
    for trial in range(400):
        vocab = int(rng.integers(2, 60))
        prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        outputs = rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
        request = Request("r", prompt, SamplingParams(max_tokens=64), output_token_ids=outputs)
        num_skipped += not last_token_recurs(request)
        assert drafter.propose(request, budget=10) == _reference(prompt + outputs, 4, 1, 3), (prompt, outputs)
    assert 0 < num_skipped < 400


@pytest.mark.parametrize("lo,hi,k", [(0, 2, 1), (3, 2, 1), (1, 2, 0)])
def test_bad_windows_are_refused(lo, hi, k):
    with pytest.raises(ValueError, match="prompt_lookup|num_draft_tokens"):
        propose_one([1, 2], k, lo, hi)
    with pytest.raises(ValueError, match="prompt_lookup|num_draft_tokens"):
        NgramProposer(k, lo, hi)


def test_the_proposer_batches_and_caps_each_sequence():
    proposer = NgramProposer(num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    seqs = [[1, 2, 3, 4, 1, 2], np.array([9, 8, 7]), [5, 6, 7, 5, 6]]
    assert proposer.propose(seqs) == [[3, 4, 1], [], [7, 5, 6]]
    assert proposer.propose(seqs, num_draft_tokens=[1, 3, 0]) == [[3], [], []]
    assert proposer.propose(seqs, num_draft_tokens=[9, 9, 9]) == [[3, 4, 1], [], [7, 5, 6]]  # k caps
    with pytest.raises(ValueError, match="3 sequences"):
        proposer.propose(seqs, num_draft_tokens=[1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        proposer.propose(seqs, num_draft_tokens=[1, -1, 1])
    with pytest.raises(ValueError, match="1-D"):
        proposer.propose([np.zeros((2, 2), dtype=np.int64)])


def test_32k_token_sequences():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 512, 32768)
    tokens[1000:1006] = tokens[-6:]  # one early occurrence of the 6-token suffix
    tokens[20000:20004] = tokens[-4:]  # a later occurrence of only its last 4 tokens
    proposer = NgramProposer(num_draft_tokens=5, prompt_lookup_min=2, prompt_lookup_max=6)
    start = time.perf_counter()
    drafts = proposer.propose([tokens] * 8)
    elapsed = time.perf_counter() - start
    assert drafts == [tokens[1006:1011].tolist()] * 8
    no_match = np.arange(32768)  # no token repeats
    assert proposer.propose([no_match]) == [[]]
    assert elapsed < 30, "guards against a quadratic scan only (8 x 32k tokens)"


def test_imports_without_torch():
    code = ("import sys, helixserve.engine.spec.ngram, helixserve.engine.spec.accept;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
