"""Speculative decoding in the scheduler (torch-free): drafts ride on decode rows within their
caps (max_tokens, max_model_len, the step budget, forced first tokens), a verified run advances
the computed count by what was appended, and the pages only rejected drafts took go back."""

from __future__ import annotations

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.request import Request, SamplingParams
from helixserve.engine.scheduler import Scheduler
from helixserve.engine.spec.drafting import NgramDrafter
from helixserve.kvcache import CacheManager

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5]  # then 6: after ..5, 6 the lookup proposes 7, 8, 5


def make(max_model_len=64, max_batched=64, tpb=4, num_blocks=64, max_num_seqs=4):
    cache = CacheManager(num_blocks, 8, tpb)
    drafter = NgramDrafter(NGRAM, max_model_len)
    return Scheduler(cache, max_num_seqs, max_batched, max_model_len, drafter=drafter), cache


def prefill(sched, rid="r", prompt=PROMPT, first=6, **params):
    request = Request(rid, list(prompt), SamplingParams(temperature=0.0, ignore_eos=True, **params))
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {rid: first})
    return request


def test_decode_row_carries_drafts_and_a_partial_run_releases_its_pages():
    sched, cache = make()
    request = prefill(sched, max_tokens=20)  # outputs [6]: suffix 5, 6 -> drafts 7, 8, 5
    out = sched.schedule()
    (seq,) = out.seqs
    assert seq.token_ids == [6, 7, 8, 5] and seq.num_draft_tokens == 3 and seq.context_len == 9
    assert cache.get("r").num_tokens == 13 and cache.stats().num_used_blocks == 4  # 9 + 4 rows: 4 pages
    updates = sched.update_from_output(out, {"r": [7, 9]})  # one draft accepted, then the correction
    assert [u.token_id for u in updates] == [7, 9] and request.output_token_ids == [6, 7, 9]
    assert request.num_computed_tokens == 11 and cache.get("r").num_tokens == 11
    assert cache.stats().num_used_blocks == 3 and cache.stats().num_reserved_blocks == 3
    out = sched.schedule()
    sched.update_from_output(out, {"r": [3]})  # nothing to look up after 9: a plain decode row
    assert out.seqs[0].num_draft_tokens == 0 and request.num_computed_tokens == 12


def test_rejected_drafts_crossing_a_page_give_it_back():
    sched, cache = make()
    prefill(sched, max_tokens=20)  # 10 tokens, 9 cached
    out = sched.schedule()
    assert out.seqs[0].num_draft_tokens == 3 and cache.stats().num_used_blocks == 4  # rows 9..12
    sched.update_from_output(out, {"r": [1]})  # all rejected: 10 cached, pages 0..2
    assert cache.get("r").num_tokens == 10 and cache.stats().num_used_blocks == 3


def start(sched, *rids):
    requests = [Request(rid, list(PROMPT), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for rid in rids]
    for request in requests:
        sched.add_request(request)
    while not all(r.output_token_ids for r in requests):
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: 6 for s in out.seqs if s.sample})
    return requests


def test_draft_caps_max_tokens_max_model_len_and_budget():
    sched, _ = make()
    prefill(sched, max_tokens=3)  # 1 output; a run may emit 2 more: 1 draft
    assert sched.schedule().seqs[0].num_draft_tokens == 1
    sched, _ = make(max_model_len=12)  # 10 tokens: positions 9, 10 may be written, 11 never
    prefill(sched, max_tokens=20)
    assert sched.schedule().seqs[0].num_draft_tokens == 1
    sched, _ = make(max_model_len=11)
    prefill(sched, max_tokens=20)
    assert sched.schedule().seqs[0].num_draft_tokens == 0
    for budget, drafts in ((12, [3, 3]), (6, [3, 1]), (5, [3, 0]), (2, [0, 0])):
        sched, _ = make(max_num_seqs=2)
        start(sched, "a", "b")
        sched.max_num_batched_tokens = budget  # two decode rows, budget - 2 draft tokens
        out = sched.schedule()
        assert [s.num_draft_tokens for s in out.seqs] == drafts and out.num_tokens == 2 + sum(drafts)


def test_no_drafts_while_forced_first_tokens_are_pending():
    sched, cache = make()
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=20, temperature=0.0),
                      forced_output_token_ids=[6, 7])
    cache.allocate("r", len(PROMPT) + 1)
    sched.add_prefilled(request)
    assert NgramDrafter(NGRAM, 64).cap(request) == 3  # both forced tokens are outputs already
    request2 = Request("q", list(PROMPT), SamplingParams(max_tokens=20), forced_output_token_ids=[6, 7, 8])
    request2.output_token_ids = [6]
    assert NgramDrafter(NGRAM, 64).cap(request2) == 0


def test_stop_inside_a_run_finishes_and_frees_everything():
    sched, cache = make()
    request = prefill(sched, max_tokens=20, stop_token_ids=(8,))
    out = sched.schedule()
    updates = sched.update_from_output(out, {"r": [7, 8, 5, 2]})
    assert [u.token_id for u in updates] == [7, 8] and updates[-1].is_finished
    assert request.output_token_ids == [6, 7, 8] and cache.stats().num_used_blocks == 0


def test_a_step_runs_ahead_only_while_no_request_would_draft():
    sched, _ = make()
    prefill(sched, prompt=[1, 2, 3, 4], first=9, max_tokens=20)  # 9 is nowhere earlier: no drafts
    out = sched.schedule()
    assert out.seqs[0].num_draft_tokens == 0
    ahead = sched.schedule_ahead()  # nothing would draft on [1, 2, 3, 4, 9]: the next step runs ahead
    assert ahead is not None and ahead.seqs[0].num_draft_tokens == 0 and ahead.seqs[0].token_ids == [-1]
    sched.update_from_output(out, {"r": 2})  # [.., 9, 2]: 2 recurs, the lookup would propose 3, 4, 9
    assert sched.schedule_ahead() is None  # so no step runs ahead of the pending (ahead) one
    sched.update_from_output(ahead, {"r": 1})  # [.., 9, 2, 1]
    out = sched.schedule()  # after [.., 2, 1] the lookup proposes 2, 3, 4
    assert out.seqs[0].token_ids == [1, 2, 3, 4] and out.seqs[0].num_draft_tokens == 3
    assert sched.schedule_ahead() is None  # it would draft again after the verified run


def test_no_step_runs_ahead_of_one_whose_request_would_draft_next():
    sched, _ = make()
    prefill(sched, prompt=[1, 2, 3, 4], first=9, max_tokens=20)
    out = sched.schedule()
    sched.update_from_output(out, {"r": 1})  # [1, 2, 3, 4, 9, 1]: 1 recurs, the lookup proposes 2, 3, 4
    out = sched.schedule()
    assert out.seqs[0].num_draft_tokens == 3
    sched.update_from_output(out, {"r": [2, 8]})  # one accepted, then 8 (nowhere earlier)
    out = sched.schedule()
    assert out.seqs[0].num_draft_tokens == 0
    assert sched.schedule_ahead() is not None  # on [.., 1, 2, 8] nothing would draft
