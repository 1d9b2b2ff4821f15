"""Speculative decoding with a draft model (``speculative.method: draft``) in the single-process
engine: greedy output equals plain decoding's token for token (prompts and outputs crossing
pages, fp32 and bf16, a draft near the target, the target's own weights, another seed's), the
target's own weights as draft accept every draft, a stop string cuts inside an accepted run, the
draft's KDA state after a rejection is a fresh draft prefill's of the accepted tokens, prompt
chunks run beside verify rows and non-speculating decodes, a seeded sampled request's tokens do
not depend on its batch; a draft of another vocabulary and prefix caching are refused at
start-up with named errors (gen worlds take a draft model); the draft's pools come out of the
cache budget and its weights and pools (cp pages a block on a CP group's leader) count in the
rank memory check."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from helixserve.cli import main
from helixserve.config import CacheConfig, GenServerConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.rank_memory import check_rank_memory
from helixserve.engine.rank_setup import size_cache
from helixserve.engine.request import SamplingParams
from helixserve.models.config import KimiModelConfig
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.presets import make_checkpoint
from helixserve.kvcache.sizing import pools_from_budget
from helixserve.planning.drafter import DraftModelError, DraftVocabMismatchError, draft_config, resolve_drafter
from helixserve.planning.memory import MIB, DeploymentDoesNotFitError, engine_pool_sizes, pool_unit_bytes
from helixserve.planning.weights import rank_weight_bytes
from helixserve.testing.drafts import perturbed_checkpoint, run_mixed

TPB = 4  # small pages: prompts, drafts and runs cross them
K = 3
PROMPTS = [list(range(20, 57)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_llm(target, draft=None, dtype=None, **sched) -> LLM:
    spec = None if draft is None else SpeculativeConfig(method="draft", draft_model=draft, num_draft_tokens=K)
    return LLM(target, dtype=dtype, cache=CacheConfig(tokens_per_block=TPB, max_num_seqs=8),
               scheduler=SchedulerConfig(**sched), speculative=spec)


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["kimi-linear-tiny"]


@pytest.fixture(scope="module")
def near(target, tmp_path_factory):
    """A draft near the target: it accepts runs of every length and rejects at every position."""
    return perturbed_checkpoint(target, tmp_path_factory.mktemp("draft") / "near", scale=0.01, seed=1)


@pytest.fixture(scope="module")
def plain(target):
    return make_llm(target)


@pytest.fixture(scope="module")
def near_llm(target, near):
    return make_llm(target, near)


def test_near_draft_greedy_equals_plain_decoding(plain, near_llm):
    params = [greedy(n) for n in (12, 9, 10)]
    ref = plain.generate(PROMPTS, params)
    got = near_llm.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    stats = near_llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    first, *_, last = stats.accepted_per_position
    assert stats.num_drafts > first > last > 0  # rejections at the first and later positions, full runs
    assert near_llm.engine.cache_manager.stats().num_used_blocks == 0


def _run_steps(llm, rid, prompt, params):
    engine = llm.engine
    request = engine.add_request(rid, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append([u.token_id for u in engine.step() if u.request_id == rid])
    return request, steps


def test_same_weights_draft_accepts_every_draft_and_a_stop_string_cuts_a_run(target, plain):
    llm = make_llm(target, target)
    prompt = PROMPTS[0]
    ref = plain.generate([prompt], greedy(14))[0]
    assert llm.generate([prompt], greedy(14))[0].token_ids == ref.token_ids
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # runs of K + 1 after the first token: outputs 1..4, 5..8, 9..12; a stop string ending inside one
    # (a string with a new character: tokens past the byte range decode to nothing)
    tokens, decode = ref.token_ids, plain.tokenizer.decode
    index, stop = next((i, decode(tokens[i - 1:i + 1])) for i in range(1, 12)
                       if i % (K + 1) and tokens[i] < 256 and decode(tokens[i - 1:i + 1]) not in decode(tokens[:i]))
    params = greedy(14, stop=(stop,))
    want = plain.generate([prompt], params)[0]
    request, steps = _run_steps(llm, "stop", prompt, params)
    assert request.output_token_ids == want.token_ids and len(want.token_ids) <= index + 1
    assert request.finish_reason == want.finish_reason == "stop" and len(steps[-1]) < K + 1


def test_other_seed_draft_equals_plain_decoding_in_bf16(target, tmp_path_factory):
    other = make_checkpoint("kimi-linear-tiny", tmp_path_factory.mktemp("draft") / "other", seed=1)
    params = [greedy(5), greedy(6)]
    ref = make_llm(target, dtype="bfloat16").generate(PROMPTS[:2], params)
    llm = make_llm(target, other, dtype="bfloat16")
    assert [r.token_ids for r in llm.generate(PROMPTS[:2], params)] == [r.token_ids for r in ref]
    assert llm.engine.spec_stats.num_drafts > 0


def _state_diff(caches, slot, fresh_caches, fresh_slot) -> float:
    return max((pool[layer][slot].float() - fresh_pool[layer][fresh_slot].float()).abs().max().item()
               for pool, fresh_pool in ((caches.kda_state, fresh_caches.kda_state),
                                        (caches.conv_state, fresh_caches.conv_state)) for layer in pool)


def _to_rejection(engine, rid, prompt):
    """Step request ``rid`` until a verify step rejected one of its drafts; its draft slot."""
    request = engine.add_request(rid, prompt, greedy(30))
    while True:
        before = (engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens)
        engine.step()
        drafted = engine.spec_stats.num_draft_tokens - before[0]
        if drafted and engine.spec_stats.num_accepted_tokens - before[1] < drafted:
            return request, engine.cache_manager.get(rid).slot


def test_draft_kda_state_after_a_rejection_equals_a_fresh_draft_prefill(near, near_llm, monkeypatch):
    """Not byte-equal: the rollback replays the decode kernels over the draft forwards' rows, the
    fresh prefill runs the chunked kernels; fp32 rounding apart (1e-4). Without the rollback the
    state is far off."""
    engine = near_llm.engine
    request, slot = _to_rejection(engine, "r", PROMPTS[0])
    accepted = request.prompt_token_ids + request.output_token_ids[:-1]
    assert request.num_computed_tokens == len(accepted)
    fresh = make_llm(near)
    fresh.engine.add_request("f", accepted, greedy(2))
    fresh.engine.step()  # the prefill: its slot holds the accepted tokens' state
    fresh_caches, fresh_slot = fresh.engine.caches, fresh.engine.cache_manager.get("f").slot
    assert _state_diff(engine.draft_runner.caches, slot, fresh_caches, fresh_slot) < 1e-4
    engine.abort("r")
    monkeypatch.setattr(engine.draft_runner, "rollback", lambda out, record, get_request: None)
    _, slot = _to_rejection(engine, "n", PROMPTS[0])
    assert _state_diff(engine.draft_runner.caches, slot, fresh_caches, fresh_slot) > 1e-2
    engine.abort("n")


def test_prompt_chunks_beside_verify_rows_and_a_seeded_request_alone(target, near, plain, monkeypatch):
    """A small budget puts prompt chunks beside verify rows; a request one token from its end
    decodes without drafts beside them; a seeded sampled request's tokens do not depend on its
    batch."""
    seeded = SamplingParams(max_tokens=7, temperature=0.8, top_k=40, seed=77, ignore_eos=True)
    params = [greedy(8), seeded, greedy(2), greedy(5)]
    ref = plain.generate(PROMPTS + [PROMPTS[1]], params)
    llm = make_llm(target, near, max_num_batched_tokens=12)
    steps, propose = [], llm.engine.draft_runner.propose

    def seen(out):  # each step's make-up: verify rows, prompt chunks, decodes without drafts
        steps.append((any(s.num_draft_tokens for s in out.seqs), any(s.is_prefill for s in out.seqs),
                      any(s.sample and not s.is_prefill and not s.num_draft_tokens for s in out.seqs)))
        return propose(out)
    monkeypatch.setattr(llm.engine.draft_runner, "propose", seen)
    reqs, mixed = run_mixed(llm.engine, ("a", PROMPTS[0], params[0]),
                            [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(PROMPTS[1:] + [PROMPTS[1]], params[1:]), 1)])
    assert mixed and any(v and p for v, p, _ in steps) and any(v and d for v, _, d in steps)
    assert [reqs[i].output_token_ids for i in (0, 2, 3)] == [ref[i].token_ids for i in (0, 2, 3)]
    alone = llm.generate([PROMPTS[1]], seeded)[0].token_ids
    assert reqs[1].output_token_ids == alone and len(alone) == 7


def test_cli_generate_with_a_draft_model(target, plain, capsys):
    ids = [9, 8, 7, 6] * 3
    base = ["generate", "--model", str(target), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "9",
            "--ignore-eos", "--json", "--speculative", "draft", "--num-draft-tokens", "2"]
    assert main(base + ["--draft-model", str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain.generate([ids], greedy(9))[0].token_ids


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(target, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    spec = SpeculativeConfig(method="draft", draft_model=bad)
    with pytest.raises(DraftVocabMismatchError, match="vocab_size 1024.*vocab_size 512") as err:
        draft_config(spec, KimiModelConfig.from_pretrained(target), CacheConfig())
    assert (err.value.draft_vocab, err.value.target_vocab) == (1024, 512)
    argv = ["generate", "--model", str(target), "--prompt-ids", "1,2", "--speculative", "draft", "--draft-model", str(bad)]
    assert main(argv) == 2 and "vocab_size 1024" in capsys.readouterr().err


def test_prefix_caching_refuses_a_draft_model_and_gen_worlds_take_one(target):
    spec = SpeculativeConfig(method="draft", draft_model=target)
    cfg = KimiModelConfig.from_pretrained(target)
    with pytest.raises(DraftModelError, match="prefix_caching"):
        draft_config(spec, cfg, CacheConfig(prefix_caching=True))
    assert GenServerConfig(dp=1, cp=1, kv_source="ucx", speculative=spec).speculative == spec
    assert GenServerConfig(dp=2, cp=2, kv_source="ucx", speculative=spec).speculative == spec
    hidden = SpeculativeConfig(method="hidden", draft_model=target)
    assert GenServerConfig(dp=1, cp=2, speculative=hidden).speculative == hidden
    assert draft_config(None, cfg, CacheConfig()) is None


def test_a_single_process_refuses_a_draft_split_over_ranks(target):
    spec = SpeculativeConfig(method="draft", draft_model=target, draft_tensor_parallel_size=2)
    with pytest.raises(DraftModelError, match="draft_tensor_parallel_size=2 must be 1 or the world's cp=1"):
        LLM(target, cache=CacheConfig(tokens_per_block=TPB), speculative=spec)


def test_the_draft_pools_come_out_of_the_cache_budget(target):
    cfg = KimiModelConfig.from_pretrained(target)
    block, slot = pool_unit_bytes(cfg, 4, TPB)
    budget = int(4.0 * MIB)
    assert engine_pool_sizes(cfg, 4, TPB, 4.0, 8) == pools_from_budget(block, slot, budget, 8)
    assert engine_pool_sizes(cfg, 4, TPB, 4.0, 8, draft=cfg) == pools_from_budget(2 * block, 2 * slot, budget, 8)
    # a CP group's leader holds the draft on full rows: cp draft pages a block, full-head draft slots
    block2, slot2 = pool_unit_bytes(cfg, 4, TPB, 2)
    assert engine_pool_sizes(cfg, 4, TPB, 4.0, 8, 2, draft=cfg) == pools_from_budget(block2 + 2 * block, slot2 + slot,
                                                                                   budget, 8)
    # its heads split over the CP group: every rank holds the full-row latent pages, half the KDA heads
    assert slot2 < slot and engine_pool_sizes(cfg, 4, TPB, 4.0, 8, 2, draft=cfg, draft_tp=2) == pools_from_budget(
        block2 + 2 * block, 2 * slot2, budget, 8)


@pytest.mark.parametrize("cp", [1, 2])
def test_the_rank_memory_check_counts_the_draft_weights_and_pools(target, cp):
    """A CP group's leader holds the draft's full rows: ``cp`` draft pages a block of its own."""
    cfg = KimiModelConfig.from_pretrained(target)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype=torch.float32)
    cache = CacheConfig(tokens_per_block=TPB, memory_budget_mib=4.0, gpu_memory_gib=1e-6)
    drafter = resolve_drafter(SpeculativeConfig(method="draft", draft_model=target), cfg, cache)
    _, layout = size_cache(cfg, torch.float32, cache, cp, drafter)
    shortfalls = []
    for draft in (None, drafter):
        with pytest.raises(DeploymentDoesNotFitError) as err:
            check_rank_memory(model, cache, SchedulerConfig(), layout, "cpu", cp=cp, drafter=draft)
        shortfalls.append(err.value.shortfall_bytes)
    block, slot = pool_unit_bytes(cfg, 4, TPB)
    draft_bytes = rank_weight_bytes(cfg, 4).total_bytes + cp * layout.num_blocks * block + layout.num_slots * slot
    assert shortfalls[1] - shortfalls[0] == draft_bytes
    if cp == 2:  # its heads over the group: their weights and KDA heads halved, the latent pages whole
        with pytest.raises(DeploymentDoesNotFitError) as err:
            check_rank_memory(model, cache, SchedulerConfig(), layout, "cpu", cp=cp,
                              drafter=replace(drafter, tp=cp))
        tp_slot = pool_unit_bytes(cfg, 4, TPB, cp)[1]
        tp_bytes = (rank_weight_bytes(cfg, 4, cp=cp, heads_tp=True).total_bytes + cp * layout.num_blocks * block
                    + layout.num_slots * tp_slot)
        assert err.value.shortfall_bytes - shortfalls[0] == tp_bytes < draft_bytes
