"""Speculative decoding with a hidden-state drafter (``speculative.method: hidden``, EAGLE-3 class) in
the single-process engine: the forward keeps the drafter's layers' outputs without changing the
logits; greedy output equals plain decoding's token for token (prompts and outputs crossing a
16-token page), also with forced drafts accepting whole runs and a stop string cutting inside one;
the drafter's cache of accepted positions equals a fresh catch-up's; prompt chunks beside verify
rows and decodes without drafts, seeded sampling reproducible; vocabulary, hidden size, layer,
prefix-caching and checkpoint-kind mismatches refused with named errors; the drafter's pool
comes out of the cache budget and its weights and pool count in the rank memory check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helixserve.cli import main
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.rank_memory import check_rank_memory
from helixserve.engine.rank_setup import size_cache
from helixserve.engine.request import SamplingParams
from helixserve.engine.spec.drafting import HiddenDraftRows, make_drafter
from helixserve.kvcache.sizing import pools_from_budget
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.config import KimiModelConfig
from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.hidden_drafter import load_hidden_drafter
from helixserve.models.hidden_drafter_config import HiddenDrafterError, read_hidden_drafter_config
from helixserve.models.kimi import WORLD_OF_ONE, KimiForCausalLM
from helixserve.models.loading import load_model
from helixserve.models.presets import make_checkpoint
from helixserve.parallel import Mapping
from helixserve.planning.drafter import DraftModelError, draft_config, hidden_config, resolve_drafter
from helixserve.planning.memory import MIB, DeploymentDoesNotFitError, engine_pool_sizes, pool_unit_bytes
from helixserve.planning.weights import rank_weight_bytes
from helixserve.testing.drafts import record_drafts, run_mixed

TPB = 16
K = 3
PROMPTS = [list(range(20, 41)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [300, 1, 2, 3, 4, 5]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_llm(target, drafter=None, **sched) -> LLM:
    spec = None if drafter is None else SpeculativeConfig(method="hidden", draft_model=drafter, num_draft_tokens=K)
    return LLM(target, cache=CacheConfig(tokens_per_block=TPB, max_num_seqs=8),
               scheduler=SchedulerConfig(**sched), speculative=spec)


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["kimi-linear-tiny"]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return make_checkpoint("kimi-linear-tiny-hidden", tmp_path_factory.mktemp("hidden") / "drafter", seed=3)


@pytest.fixture(scope="module")
def plain(target):
    return make_llm(target)


@pytest.fixture(scope="module")
def hidden_llm(target, drafter):
    return make_llm(target, drafter)


def test_the_forward_keeps_the_asked_layers_outputs_and_the_same_logits(target):
    model = load_model(target)
    tokens = list(range(3, 40))
    outs = []
    for capture in (None, HiddenCapture((0, 2, 3))):
        caches = allocate_caches(model.cfg, 4, TPB, 1)
        batch = build_batch([SeqChunk(tokens, 0, 0)], TPB, 4)
        batch.hidden_capture = capture
        outs.append(model(batch, caches))
    assert torch.equal(outs[0], outs[1])
    features = capture.features()
    assert features.shape == (len(tokens), 3 * model.cfg.hidden_size)
    assert torch.equal(features[:, -model.cfg.hidden_size:], capture.states[3])


def test_hidden_greedy_equals_plain_decoding(plain, hidden_llm):
    params = [greedy(n) for n in (14, 9, 12)]  # prompt + outputs cross a 16-token page
    ref = plain.generate(PROMPTS, params)
    got = hidden_llm.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    engine = hidden_llm.engine
    assert engine.spec_stats.num_drafts > 0 and engine.runner.decode_graphs is None
    assert engine.cache_manager.stats().num_used_blocks == 0 and not engine.draft_runner._seqs


def test_forced_drafts_accept_runs_and_a_stop_string_cuts_inside_one(target, drafter, plain):
    prompt = PROMPTS[0]
    ref = plain.generate([prompt], greedy(14))[0]
    llm = make_llm(target, drafter)
    record_drafts(llm.engine, {tuple(prompt): ref.token_ids})
    assert llm.generate([prompt], greedy(14))[0].token_ids == ref.token_ids
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # runs of K + 1 after the first token: a stop string ending inside one (a new character)
    tokens, decode = ref.token_ids, plain.tokenizer.decode
    index, stop = next((i, decode(tokens[i - 1:i + 1])) for i in range(1, 12)
                       if i % (K + 1) and tokens[i] < 256 and decode(tokens[i - 1:i + 1]) not in decode(tokens[:i]))
    want = plain.generate([prompt], greedy(14, stop=(stop,)))[0]
    got = llm.generate([prompt], greedy(14, stop=(stop,)))[0]
    assert got.token_ids == want.token_ids and len(want.token_ids) <= index + 1
    assert got.finish_reason == want.finish_reason == "stop"


def _drafter_kv(llm, rid, num_positions):
    engine = llm.engine
    blocks = engine.cache_manager.get(rid).block_ids
    pool = engine.draft_runner.caches.mla_kv[0]
    return torch.cat([pool[b] for b in blocks])[:num_positions]


def test_drafter_cache_of_accepted_positions_equals_a_fresh_catch_up(target, drafter, plain):
    """After verify steps accepting whole runs, the drafter's cache of positions ``0 .. c`` (c:
    the last step's context) equals the one a fresh request of those tokens gets (a prefill, then
    one catch-up); a drafter catching up from the wrong rows is far off."""
    prompt = PROMPTS[0]
    ref = plain.generate([prompt], greedy(20))[0].token_ids
    llm = make_llm(target, drafter)
    record_drafts(llm.engine, {tuple(prompt): ref})
    engine = llm.engine
    engine.add_request("r", prompt, greedy(20))
    for _ in range(4):  # the prefill and three verify steps of K + 1 tokens each
        engine.step()
    c = len(prompt) + 2 * (K + 1)  # the last step's context: the prompt, then two accepted runs of K + 1
    assert engine.draft_runner._seqs["r"].synced == c + 1
    fresh = make_llm(target, drafter)
    fresh.engine.add_request("f", prompt + ref[:c - len(prompt)], greedy(3))
    fresh.engine.step()
    fresh.engine.step()  # catch-up rows 1 .. c
    got, want = _drafter_kv(llm, "r", c + 1), _drafter_kv(fresh, "f", c + 1)
    assert (got - want).abs().max().item() < 1e-4
    assert (got[1:] - want[:-1]).abs().max().item() > 1e-2  # a shift by one row is far off
    engine.abort("r")


def test_prompt_chunks_beside_verify_rows_and_seeded_sampling(target, drafter, plain):
    """A small budget puts prompt chunks beside verify rows; a request one token from its end
    decodes without drafts beside them; a seeded sampled request gives the same tokens twice."""
    seeded = SamplingParams(max_tokens=7, temperature=0.8, top_k=40, seed=77, ignore_eos=True)
    params = [greedy(8), seeded, greedy(2), greedy(5)]
    ref = plain.generate(PROMPTS + [PROMPTS[1]], params)
    llm = make_llm(target, drafter, max_num_batched_tokens=12)
    others = [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(PROMPTS[1:] + [PROMPTS[1]], params[1:]), 1)]
    reqs, mixed = run_mixed(llm.engine, ("a", PROMPTS[0], params[0]), others)
    assert mixed
    assert [reqs[i].output_token_ids for i in (0, 2, 3)] == [ref[i].token_ids for i in (0, 2, 3)]
    again = llm.generate([PROMPTS[1]], seeded)[0].token_ids
    assert again == llm.generate([PROMPTS[1]], seeded)[0].token_ids and len(again) == 7


def test_cli_generate_with_a_hidden_drafter(target, drafter, plain, capsys):
    ids = [9, 8, 7, 6] * 3
    argv = ["generate", "--model", str(target), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "6",
            "--ignore-eos", "--json", "--speculative", "hidden", "--num-draft-tokens", "2", "--draft-model", str(drafter)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain.generate([ids], greedy(6))[0].token_ids


def _edited(drafter, tmp_path, **changes):
    bad = tmp_path / "bad"
    shutil.copytree(drafter, bad)
    config = json.loads((bad / "config.json").read_text())
    for key, value in changes.items():
        if key in config["hidden_drafter"]:
            config["hidden_drafter"][key] = value
        else:
            config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": 1024}, "vocab_size 1024, the target model has vocab_size 512"),
    ({"hidden_layers": [0, 4]}, r"reads target layers \[0, 4\]; the target has 4 layers .*\[4\] out of range"),
    ({"target_hidden_size": 64}, "hidden states of size 64, the target model's hidden_size is 128"),
])
def test_a_drafter_that_cannot_read_the_target_is_refused(target, drafter, tmp_path, changes, message):
    spec = SpeculativeConfig(method="hidden", draft_model=_edited(drafter, tmp_path, **changes))
    with pytest.raises(HiddenDrafterError, match=message):
        hidden_config(spec, KimiModelConfig.from_pretrained(target), CacheConfig())


def test_prefix_caching_and_the_wrong_checkpoint_kind_are_refused(target, drafter, capsys):
    cfg = KimiModelConfig.from_pretrained(target)
    spec = SpeculativeConfig(method="hidden", draft_model=drafter)
    assert isinstance(make_drafter(spec, 64), HiddenDraftRows)
    with pytest.raises(HiddenDrafterError, match="prefix_caching"):
        hidden_config(spec, cfg, CacheConfig(prefix_caching=True))
    with pytest.raises(HiddenDrafterError, match="not a hidden-state drafter"):
        hidden_config(SpeculativeConfig(method="hidden", draft_model=target), cfg, CacheConfig())
    with pytest.raises(DraftModelError, match="is a hidden-state drafter: use method 'hidden'"):
        draft_config(SpeculativeConfig(method="draft", draft_model=drafter), cfg, CacheConfig())
    argv = ["generate", "--model", str(target), "--prompt-ids", "1,2", "--speculative", "hidden", "--draft-model",
            str(target)]
    assert main(argv) == 2 and "not a hidden-state drafter" in capsys.readouterr().err


def test_the_drafter_pool_comes_out_of_the_cache_budget(target, drafter, hidden_llm):
    cfg = KimiModelConfig.from_pretrained(target)
    hidden_cfg, hidden_spec = read_hidden_drafter_config(drafter)
    assert hidden_spec.hidden_layers == (0, 2, 3) and hidden_cfg.mla_layer_ids == [0] and not hidden_cfg.kda_layer_ids
    block, slot = pool_unit_bytes(cfg, 4, TPB)
    hidden_block, hidden_slot = pool_unit_bytes(hidden_cfg, 4, TPB)
    assert hidden_block > 0 and hidden_slot == 0
    assert (engine_pool_sizes(cfg, 4, TPB, 4.0, 8, draft=hidden_cfg)
            == pools_from_budget(block + hidden_block, slot, int(4.0 * MIB), 8))
    # a slot also holds the feature row of a prompt's last position (the drafter's prompt cache)
    hidden = resolve_drafter(SpeculativeConfig(method="hidden", draft_model=drafter), cfg, CacheConfig())
    features = hidden.slot_features
    assert features == 3 * cfg.hidden_size and hidden.budget_args(4)["draft_slot_bytes"] == 4 * features
    assert (engine_pool_sizes(cfg, 4, TPB, 4.0, 8, draft=hidden_cfg, draft_slot_bytes=4 * features)
            == pools_from_budget(block + hidden_block, slot + 4 * features, int(4.0 * MIB), 8))
    engine = hidden_llm.engine
    _, layout = size_cache(cfg, torch.float32, CacheConfig(tokens_per_block=TPB, max_num_seqs=8), drafter=hidden)
    assert engine.layout == layout
    assert engine.draft_runner.prompt_cache.features.shape == (layout.num_slots + 1, features)
    assert engine.draft_runner.caches.mla_kv[0].shape[0] == layout.num_blocks


@pytest.mark.parametrize("cp", [1, 2])
def test_the_rank_memory_check_counts_the_drafter_weights_and_pool(target, drafter, cp):
    """Every rank counts the drafter's full-row pages and feature rows; its weights whole, or its
    heads' share of them with its heads over the CP group (``draft_tp`` = cp)."""
    cfg = KimiModelConfig.from_pretrained(target)
    hidden_cfg, _ = read_hidden_drafter_config(drafter)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype=torch.float32)
    cache = CacheConfig(tokens_per_block=TPB, memory_budget_mib=4.0, gpu_memory_gib=1e-6)
    for tp in sorted({1, cp}):
        spec = SpeculativeConfig(method="hidden", draft_model=drafter, draft_tensor_parallel_size=tp)
        hidden = resolve_drafter(spec, cfg, cache)
        _, layout = size_cache(cfg, torch.float32, cache, cp, drafter=hidden)
        shortfalls = []
        for draft in (None, hidden):
            with pytest.raises(DeploymentDoesNotFitError) as err:
                check_rank_memory(model, cache, SchedulerConfig(), layout, "cpu", cp=cp, drafter=draft)
            shortfalls.append(err.value.shortfall_bytes)
        mapping = Mapping(cp, 0, dp=1, cp=cp, heads_tp=True) if tp > 1 else WORLD_OF_ONE
        weights = sum(p.numel() for p in load_hidden_drafter(drafter, mapping=mapping).parameters()) * 4
        assert weights == rank_weight_bytes(hidden_cfg, 4, cp=tp, heads_tp=tp > 1).total_bytes + 4 * hidden.extra_params
        assert weights == hidden.weight_bytes(4).total_bytes
        # the group's full-row MLA pages, and a feature row per slot plus a spare (the prompt
        # cache a ctx worker sends)
        pages = cp * layout.num_blocks * pool_unit_bytes(hidden_cfg, 4, TPB)[0]
        assert shortfalls[1] - shortfalls[0] == weights + pages + (layout.num_slots + 1) * 4 * hidden.slot_features
