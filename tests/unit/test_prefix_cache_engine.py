"""Prefix caching on the single engine: greedy tokens equal caching off token for token, the hit is
the longest prefix with both its blocks and a KDA state checkpoint, and a checkpoint holds the
state a fresh prefill has at its position, bit for bit."""

from __future__ import annotations

import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.rank_setup import size_cache
from helixserve.kvcache.pools import bytes_per_block, bytes_per_slot
from helixserve.kvcache.prefix_index import append_block_keys
from helixserve.models.presets import get_preset

BLOCK = 4
INTERVAL_BLOCKS = 2  # a checkpoint every 8 tokens, and at each prompt's last full block
PRESETS = ("kimi-linear-tiny", "kimi-k3-tiny")


def greedy(n: int = 5, salt: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, cache_salt=salt)


def cache(prefix_caching: bool, **kw) -> CacheConfig:
    return CacheConfig(tokens_per_block=BLOCK, max_num_seqs=4, prefix_caching=prefix_caching,
                       state_checkpoint_blocks=INTERVAL_BLOCKS, **kw)


@pytest.fixture(scope="module", params=[(p, d) for p in PRESETS for d in ("float32", "bfloat16")],
                ids=lambda v: f"{v[0]}-{v[1]}")
def engines(request, tiny_checkpoints):
    preset, dtype = request.param
    path = tiny_checkpoints[preset]
    return LLM(path, dtype=dtype, cache=cache(False)), LLM(path, dtype=dtype, cache=cache(True))


def expected_hit(first_len: int, shared: int, second_len: int) -> int:
    """The checkpoint positions the first prompt's prefill leaves, within the shared full blocks and
    short of the second prompt's last token."""
    positions = set(range(INTERVAL_BLOCKS * BLOCK, first_len + 1, INTERVAL_BLOCKS * BLOCK))
    positions.add((first_len - 1) // BLOCK * BLOCK)
    limit = min(shared // BLOCK * BLOCK, second_len - 1)
    return max((p for p in positions if p <= limit), default=0)


def run(llm: LLM, rid: str, prompt: list[int], params: SamplingParams):
    engine = llm.engine
    request = engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return request


@pytest.mark.parametrize("shared", [0, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 5 * BLOCK + 3])
def test_prompts_sharing_a_prefix_give_the_tokens_of_caching_off(engines, shared):
    off, on = engines
    on.engine.cache_manager.reset_prefix_cache()
    base = list(range(40, 40 + shared))
    first, second = base + [7, 8, 9], base + [11, 12, 13, 14, 15]
    for i, prompt in enumerate((first, second)):
        want = run(off, f"off-{shared}-{i}", prompt, greedy()).output_token_ids
        got = run(on, f"on-{shared}-{i}", prompt, greedy())
        assert got.output_token_ids == want
    assert got.num_cached_tokens == expected_hit(len(first), shared, len(second))
    assert on.engine.cache_manager.stats().num_used_blocks == 0


def test_the_same_request_twice_hits_all_but_its_last_block_and_agrees(engines):
    off, on = engines
    on.engine.cache_manager.reset_prefix_cache()
    prompt = list(range(100, 100 + 6 * BLOCK))  # block aligned: the last token is computed again
    want = run(off, "twice-off", prompt, greedy(7)).output_token_ids
    first = run(on, "twice-0", prompt, greedy(7))
    again = run(on, "twice-1", prompt, greedy(7))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 5 * BLOCK
    assert first.output_token_ids == again.output_token_ids == want


def test_a_batch_of_prompts_sharing_a_prefix_agrees_with_caching_off(engines):
    off, on = engines
    on.engine.cache_manager.reset_prefix_cache()
    system = list(range(200, 200 + 3 * BLOCK + 2))
    prompts = [system + [i, i + 1, i + 2][: i % 3 + 1] for i in range(6)]
    want = [r.token_ids for r in off.generate(prompts, greedy(4))]
    assert [r.token_ids for r in on.generate(prompts, greedy(4))] == want  # computed together
    hits_before = on.engine.cache_manager.prefix_stats.num_hit_tokens
    assert [r.token_ids for r in on.generate(prompts, greedy(4))] == want  # from the cache
    assert on.engine.cache_manager.prefix_stats.num_hit_tokens - hits_before >= len(prompts) * 3 * BLOCK


def test_two_salts_never_share_a_block(engines):
    _, on = engines
    manager = on.engine.cache_manager
    manager.reset_prefix_cache()
    prompt = list(range(300, 300 + 4 * BLOCK + 1))
    assert run(on, "salt-a0", prompt, greedy(2, "tenant-a")).num_cached_tokens == 0
    assert run(on, "salt-b0", prompt, greedy(2, "tenant-b")).num_cached_tokens == 0
    assert run(on, "nosalt", prompt, greedy(2)).num_cached_tokens == 0
    assert run(on, "salt-a1", prompt, greedy(2, "tenant-a")).num_cached_tokens == 4 * BLOCK
    assert manager.blocks.num_cached == 3 * 4  # each salt its own four blocks


def test_chunks_stop_at_checkpoint_positions_even_when_the_budget_is_not_block_aligned(tiny_checkpoints):
    """A token budget of 7 (not a multiple of the block) still leaves checkpoints exactly at 8, 16
    and the last full block before the prompt's last token; the second request resumes there."""
    path = tiny_checkpoints["kimi-linear-tiny"]
    sched = SchedulerConfig(max_num_batched_tokens=7)
    off, on = LLM(path, cache=cache(False), scheduler=sched), LLM(path, cache=cache(True), scheduler=sched)
    prompt = list(range(50, 50 + 22))
    run(on, "a", prompt, greedy(3))
    manager = on.engine.cache_manager
    assert manager.checkpoints.num_committed == 3  # at 8, 16 and 20
    again = run(on, "b", prompt + [1, 2, 3], greedy(3))
    assert again.num_cached_tokens == 20
    assert again.output_token_ids == run(off, "b", prompt + [1, 2, 3], greedy(3)).output_token_ids


@pytest.mark.parametrize("budget", [BLOCK * INTERVAL_BLOCKS, 3 * BLOCK + 1], ids=["chunk-end", "inside-chunk"])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_checkpoint_holds_the_state_of_a_fresh_prefill_at_its_position(tiny_checkpoints, preset, budget):
    """fp32: the recurrent and conv state saved at 8 tokens equal those of a prefill of the same 8
    tokens with caching off (read from its slot while it runs): bit for bit when saved after a
    chunk that ends there; taken inside a chunk of the whole 13-token prompt, within 1e-4: there the
    13 rows are computed as one chunk and the fresh prefill's 8 as another, which on some CPUs
    rounds differently (up to 1.7e-5 in the first layer's conv inputs measured on an AMD EPYC with
    AVX-512; bit for bit on others, and on the GPU: tests/unit/test_gpu_prefix_cache.py). A state
    of another position differs by orders of magnitude more."""
    path = tiny_checkpoints[preset]
    on = LLM(path, cache=cache(True), scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    off = LLM(path, cache=cache(False), scheduler=SchedulerConfig(max_num_batched_tokens=BLOCK * INTERVAL_BLOCKS))
    prompt = list(range(60, 60 + 3 * BLOCK + 1))
    run(on, "on", prompt, greedy(2))
    fresh = off.engine.add_request("fresh", prompt, greedy(2))
    off.engine.step()  # the first chunk: tokens [0, 8)
    assert fresh.num_computed_tokens == BLOCK * INTERVAL_BLOCKS
    slot = off.engine.cache_manager.get("fresh").slot
    keys: list[bytes] = []
    append_block_keys(keys, prompt[: BLOCK * INTERVAL_BLOCKS], BLOCK, None)
    checkpoint = on.engine.cache_manager.checkpoints.lookup(keys[-1])
    assert checkpoint is not None
    saved, live = on.engine.runner.checkpoints, off.engine.caches
    assert saved.kda_state and saved.kda_state.keys() == live.kda_state.keys()
    tolerance = {"rtol": 0.0, "atol": 0.0 if budget == BLOCK * INTERVAL_BLOCKS else 1e-4}
    for layer in live.kda_state:
        assert saved.kda_state[layer].dtype == torch.float32
        torch.testing.assert_close(saved.kda_state[layer][checkpoint], live.kda_state[layer][slot], **tolerance)
        torch.testing.assert_close(saved.conv_state[layer][checkpoint], live.conv_state[layer][slot], **tolerance)
    while off.engine.has_unfinished_requests():
        off.engine.step()


def test_checkpoint_slots_come_out_of_every_ranks_budget_with_caching_on(tiny_checkpoints):
    cfg = get_preset("kimi-k3-tiny")
    single = size_cache(cfg, torch.float32, cache(True), 1)[1]
    group_rank = size_cache(cfg, torch.float32, cache(True), 2)[1]
    off = size_cache(cfg, torch.float32, cache(False), 1)[1]
    assert single.num_checkpoint_slots == group_rank.num_checkpoint_slots == 32 and off.num_checkpoint_slots == 0
    assert off.num_blocks > single.num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_checkpoints_do_not_cut_a_prefill_into_more_steps(tiny_checkpoints, caching):
    """A 22-token prompt under a budget of 32 is one prefill step with caching on as off, though
    it covers three checkpoint positions (8, 16, 20); the second request resumes at 20."""
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], cache=cache(caching), scheduler=SchedulerConfig(max_num_batched_tokens=32))
    prompt = list(range(80, 102))
    request = llm.engine.add_request("a", prompt, greedy(1))
    llm.engine.step()
    assert request.num_computed_tokens == len(prompt)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    if caching:
        assert llm.engine.cache_manager.checkpoints.num_committed == 3
        assert run(llm, "b", prompt + [7], greedy(1)).num_cached_tokens == 20


def test_under_cache_pressure_preempted_requests_recompute_from_the_cache_and_agree(tiny_checkpoints):
    """9 blocks of 4 tokens, 3 sequences sharing a 9-token prefix: decodes preempt, a preempted
    request comes back through the prefix cache (its own blocks, or evicted and computed again),
    and the tokens equal caching off with the same pressure; nothing stays held."""
    path = tiny_checkpoints["kimi-linear-tiny"]
    spec = cache_spec_for(LLM(path).model_config, torch.float32, BLOCK)
    checkpoints = 4
    budget = ((3 + checkpoints) * bytes_per_slot(spec) + 9 * bytes_per_block(spec)) / 2**20
    shared = list(range(70, 79))
    prompts = [shared + [1], shared + [2, 3], shared[:5] + [4]]
    runs = []
    for caching in (False, True):
        llm = LLM(path, cache=CacheConfig(tokens_per_block=BLOCK, max_num_seqs=3, memory_budget_mib=budget,
                                          prefix_caching=caching, state_checkpoint_blocks=INTERVAL_BLOCKS,
                                          state_checkpoint_slots=checkpoints))
        engine = llm.engine
        assert engine.layout.num_blocks == (9 if caching else 9 + checkpoints * bytes_per_slot(spec)
                                            // bytes_per_block(spec))
        reqs = [engine.add_request(f"p{i}", p, greedy(12)) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats().num_used_blocks == engine.stats().num_used_slots == 0
        runs.append(reqs)
    off, on = runs
    assert any(r.num_preemptions for r in on)  # the pressure is real
    assert engine.cache_manager.prefix_stats.num_hits > 0 and engine.cache_manager.blocks.num_evictions > 0
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]


def test_speculative_decoding_with_prefix_caching_gives_plain_decodings_tokens(tiny_checkpoints):
    """Rejected drafts roll blocks back (``shrink``); what stays published is what was accepted:
    a repeat of the prompt and its output, read from the cache, still decodes alike."""
    path = tiny_checkpoints["kimi-linear-tiny"]
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    plain = LLM(path, cache=cache(False))
    speculating = LLM(path, cache=cache(True), speculative=spec)
    prompt = ([5, 6, 7, 8] * 6)[:22]
    first = run(speculating, "s0", prompt, greedy(16))
    assert first.output_token_ids == run(plain, "p0", prompt, greedy(16)).output_token_ids
    longer = prompt + first.output_token_ids + [9]
    again = run(speculating, "s1", longer, greedy(8))
    assert again.num_cached_tokens and again.num_cached_tokens >= 20
    assert again.output_token_ids == run(plain, "p1", longer, greedy(8)).output_token_ids
    assert speculating.engine.spec_stats.num_draft_tokens > 0
