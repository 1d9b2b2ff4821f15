"""Draft verification: greedy acceptance equals plain greedy decoding; rejection sampling emits
tokens distributed as the target's (chi-square on a tiny vocabulary, one-hot and non-trivial
draft distributions, with top-k / top-p), and a wrong draft distribution is caught by the same
test; seeded rows do not depend on their batch."""

from __future__ import annotations

import pytest
import torch

from helixserve.engine.request import SamplingParams
from helixserve.engine.sampler import sample
from helixserve.engine.spec.verify import greedy_accept, rejection_sample, target_probs, verify_drafts

V = 8
GREEDY = SamplingParams(temperature=0)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` over the cells with probability > 0 (a count
    in a zero-probability cell fails outright)."""
    n = counts.sum().double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts.tolist()}"
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _logits_for(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("drafts,argmaxes,num_accepted,emitted", [
    ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted: the bonus
    ([5, 2, 3], [1, 2, 3, 4], 0, [1]),  # first rejected: the correction
    ([1, 6, 3], [1, 2, 3, 4], 1, [1, 2]),  # middle rejected
    ([1, 2, 7], [1, 2, 3, 4], 2, [1, 2, 3]),  # last rejected
])
def test_greedy_acceptance(drafts, argmaxes, num_accepted, emitted):
    out = greedy_accept(_logits_for(argmaxes)[None], torch.tensor([drafts]), [3])
    assert out.num_accepted.tolist() == [num_accepted]
    assert out.token_ids[0].tolist() == emitted + [-1] * (3 - num_accepted)


def test_greedy_rows_with_fewer_drafts_ignore_the_padding():
    logits = torch.stack([_logits_for([1, 2, 3, 4]), _logits_for([6, 0, 0, 0]), _logits_for([1, 2, 3, 4])])
    # row 1 has no draft (its padding equals the argmax and must not count); row 2 has two
    drafts = torch.tensor([[1, 2, 3], [0, 0, 0], [1, 2, 3]])
    out = greedy_accept(logits, drafts, [3, 0, 2])
    assert out.num_accepted.tolist() == [3, 0, 2]
    assert out.token_ids.tolist() == [[1, 2, 3, 4], [6, -1, -1, -1], [1, 2, 3, -1]]


def test_greedy_emits_what_plain_greedy_decoding_emits():
    """Each emitted token is the argmax of the logits it follows, as the sampler picks it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 5, V, generator=gen)
    drafts = torch.where(torch.rand(64, 4, generator=gen) < 0.7, logits[:, :4].argmax(-1),
                         torch.randint(0, V, (64, 4), generator=gen))
    out = verify_drafts(logits, drafts, [4] * 64, [GREEDY] * 64)
    for b in range(64):
        n = int(out.num_accepted[b])
        plain = sample(logits[b, : n + 1], [GREEDY] * (n + 1))
        assert out.token_ids[b, : n + 1].tolist() == plain


# ---------------------------------------------------------------- rejection sampling

TRIALS = 6000
TARGET = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2],
                       [0.3, -0.2, 1.1, 0.0, 0.7, -1.0, 0.4, 0.9],
                       [-0.5, 0.5, 0.0, 1.5, -1.0, 1.0, 0.2, 0.1]])
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


def _trials(params: SamplingParams, draft_q: torch.Tensor | None, claimed_q: torch.Tensor | None,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``TRIALS`` rows of the same context: drafts drawn from ``draft_q`` ``[2, V]`` (``None``: the
    fixed drafts 0, 2, a deterministic drafter), verified with ``claimed_q`` as the draft's
    distribution."""
    gen = torch.Generator().manual_seed(seed)
    if draft_q is None:
        drafts = torch.tensor([[0, 2]]).expand(TRIALS, 2)
    else:
        drafts = torch.stack([torch.multinomial(draft_q[j], TRIALS, replacement=True, generator=gen)
                              for j in range(2)], dim=1)
    probs = None if claimed_q is None else claimed_q.expand(TRIALS, 2, V)
    logits = TARGET.expand(TRIALS, 3, V)
    out = rejection_sample(logits, drafts, [2] * TRIALS, [params] * TRIALS, [gen] * TRIALS, probs)
    return out.token_ids, out.num_accepted


def _draft_q() -> torch.Tensor:
    return torch.tensor([[0.05, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.4, 0.1, 0.1, 0.0, 0.1, 0.1]])


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7_topk5_topp0.9"])
@pytest.mark.parametrize("drafter", ["one_hot", "sampled_q"])
def test_the_first_emitted_token_follows_the_target(params, drafter):
    q = None if drafter == "one_hot" else _draft_q()
    tokens, num_accepted = _trials(params, q, q)
    p0 = target_probs(TARGET[:1], [params])[0]
    counts = torch.bincount(tokens[:, 0], minlength=V)
    assert _chi_square_p_value(counts, p0) > 1e-3, (counts.tolist(), (p0 * TRIALS).tolist())
    assert 0 < int((num_accepted == 2).sum()) < TRIALS  # both outcomes occur


@pytest.mark.parametrize("drafter", ["one_hot", "sampled_q"])
def test_the_bonus_token_follows_the_target(drafter):
    q = None if drafter == "one_hot" else _draft_q()
    tokens, num_accepted = _trials(PARAMS[0], q, q, seed=1)
    full = num_accepted == 2
    p2 = target_probs(TARGET[2:], [PARAMS[0]])[0]
    counts = torch.bincount(tokens[full, 2], minlength=V)
    assert int(full.sum()) > 300
    assert _chi_square_p_value(counts, p2) > 1e-3, counts.tolist()


def test_a_wrong_draft_distribution_fails_the_test():
    """Drafts drawn from q but verified as if drawn from another distribution: the first token's
    distribution moves off the target's and the chi-square test above rejects it."""
    wrong = torch.full((2, V), 1.0 / V)
    tokens, _ = _trials(PARAMS[0], _draft_q(), wrong)
    p0 = target_probs(TARGET[:1], [PARAMS[0]])[0]
    assert _chi_square_p_value(torch.bincount(tokens[:, 0], minlength=V), p0) < 1e-6


def test_a_draft_outside_top_k_is_always_rejected():
    params = SamplingParams(temperature=1.0, top_k=2)  # TARGET row 0 keeps tokens 0 and 1
    gen = torch.Generator().manual_seed(5)
    out = rejection_sample(TARGET.expand(500, 3, V), torch.tensor([[3, 2]]).expand(500, 2), [2] * 500,
                           [params] * 500, [gen] * 500)
    assert out.num_accepted.eq(0).all()
    assert set(out.token_ids[:, 0].tolist()) == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 4, V, generator=gen)
    drafts = torch.randint(0, V, (5, 3), generator=gen)
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(5)]
    counts = [3, 1, 0, 2, 3]
    alone = [verify_drafts(logits[b:b + 1], drafts[b:b + 1], counts[b:b + 1], params[b:b + 1],
                           [torch.Generator().manual_seed(b)]).token_ids[0] for b in range(5)]
    mixed_params = [GREEDY if b == 1 else p for b, p in enumerate(params)]
    batch = verify_drafts(logits, drafts, counts, mixed_params, [torch.Generator().manual_seed(b) for b in range(5)])
    for b in (0, 2, 3, 4):
        assert torch.equal(batch.token_ids[b], alone[b]), b
    assert batch.token_ids[1].tolist()[:2] == greedy_accept(logits[1:2], drafts[1:2], [1]).token_ids[0].tolist()[:2]


@pytest.mark.parametrize("call", [
    lambda: greedy_accept(torch.zeros(2, 4, V), torch.zeros(2, 2, dtype=torch.int64), [2, 2]),
    lambda: greedy_accept(torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.int64), [2]),
    lambda: greedy_accept(torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.int64), [2, 3]),
    lambda: rejection_sample(torch.zeros(1, 3, V), torch.zeros(1, 2, dtype=torch.int64), [2],
                             [PARAMS[0]], draft_probs=torch.zeros(1, 3, V)),
    lambda: target_probs(torch.zeros(1, V), [GREEDY]),
])
def test_bad_shapes_and_counts_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_zero_drafts_sample_the_target_itself():
    gen = torch.Generator().manual_seed(4)
    out = rejection_sample(TARGET[:1].expand(TRIALS, 1, V), torch.zeros(TRIALS, 0, dtype=torch.int64),
                           [0] * TRIALS, [PARAMS[0]] * TRIALS, [gen] * TRIALS)
    assert out.num_accepted.eq(0).all()
    counts = torch.bincount(out.token_ids[:, 0], minlength=V)
    assert _chi_square_p_value(counts, target_probs(TARGET[:1], [PARAMS[0]])[0]) > 1e-3
