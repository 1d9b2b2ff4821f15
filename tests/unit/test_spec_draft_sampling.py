"""Speculative decoding with a draft model at temperature > 0 keeps the target's distribution: over
many seeded requests, the joint frequencies of the first three output tokens (the first sampled
after the prefill, the next two from verify steps, accepted drafts or corrections at draft
positions 1 and 2) equal the target's ``P(t0) P(t1 | t0) P(t2 | t0, t1)``, computed from the
target model's logits (Pearson's chi-square on top-k's tiny support). Accepting a draft while it
equals the target's argmax (greedy acceptance at temperature > 0) fails this test."""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.testing.drafts import perturbed_checkpoint
from helixserve.training.trainer import window_logits

PROMPT = [40, 41, 42]
TOP_K, TEMPERATURE = 3, 2.0  # 27 cells for three tokens, spread enough that drafts get rejected
TRIALS = 600
NUM_TOKENS = 3


def _expected_joint(llm: LLM) -> dict[tuple[int, ...], float]:
    """``P(t0, t1, t2)`` of plain sampling: each position's softmax(logits / T) over its top k."""
    model = llm.engine.runner.model

    def dist(contexts: list[list[int]]) -> list[dict[int, float]]:
        with torch.inference_mode():
            logits = window_logits(model, torch.tensor(contexts)).view(len(contexts), len(contexts[0]), -1)[:, -1]
        top = logits.float().topk(TOP_K, dim=-1)
        probs = (top.values / TEMPERATURE).softmax(dim=-1)
        return [dict(zip(i.tolist(), p.tolist())) for i, p in zip(top.indices, probs)]

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(joint)
        nexts = dist([PROMPT + list(p) for p in prefixes])
        joint = {p + (t,): joint[p] * q for p, d in zip(prefixes, nexts) for t, q in d.items()}
    return joint


def _p_value(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> float:
    outside = {k: n for k, n in counts.items() if k not in expected}
    assert not outside, f"token runs outside the target's support: {outside}"
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["kimi-linear-tiny"]


def test_sampled_tokens_with_a_draft_model_follow_the_targets_distribution(target, tmp_path):
    near = perturbed_checkpoint(target, tmp_path / "near", scale=0.01, seed=1)
    cache = CacheConfig(tokens_per_block=4, max_num_seqs=TRIALS)
    llm = LLM(target, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=TRIALS * len(PROMPT)),
              speculative=SpeculativeConfig(method="draft", draft_model=near, num_draft_tokens=2))
    params = [SamplingParams(max_tokens=NUM_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, seed=s, ignore_eos=True)
              for s in range(TRIALS)]
    results = llm.generate([PROMPT] * TRIALS, params)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.spec_stats
    # every request verified drafts at both positions, some accepted and some rejected
    assert stats.num_drafts >= TRIALS and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    expected = _expected_joint(llm)
    assert len(expected) == TOP_K ** NUM_TOKENS
    p_value = _p_value(counts, expected)
    assert p_value > 1e-3, (p_value, sorted(counts.items()))
