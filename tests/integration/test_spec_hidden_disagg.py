"""A hidden drafter's prompt cache built on a ctx engine and sent with the request to a gen engine
(the real KV sender and receiver over UCX in one process; the gen side a world of one, gloo).

The ctx engine (``speculative.method: hidden``) prefills each prompt with its cache held; the
drafter runs over the prompt there as the aggregated engine does, and its pages and the target's
features of the last prompt position travel in the leader's shard. Then, with the drafts of two
prompts replaced by plain decoding's outputs (accepted runs) and the third's the drafter's own:

- the gen engine's drafts, step by step, are the aggregated engine's, and so are its tokens and
  counts;
- a gen engine whose ctx sends no drafter cache (its layout names none) rebuilds it from the
  prompt tokens with zero features: its drafts differ (what the test above would catch);
- nothing stays allocated on either side, and no received drafter cache waits for its request.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.config import CacheConfig, SpeculativeConfig  # noqa: E402
from helixserve.config_transceiver import TransceiverConfig  # noqa: E402
from helixserve.engine.core import EngineCore  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.engine.world_rank import WorldOptions, build_rank  # noqa: E402
from helixserve.models.presets import make_checkpoint  # noqa: E402
from helixserve.parallel import Mapping, init_parallel  # noqa: E402
from helixserve.serving.loading import drafter_prompt_layout, kv_layout  # noqa: E402
from helixserve.testing.drafts import record_drafts  # noqa: E402
from helixserve.transceiver.ctx.sender import KVSender  # noqa: E402
from helixserve.transceiver.gen.receiver import KVReceiver  # noqa: E402
from helixserve.transceiver.ticket import KVTicket  # noqa: E402

PRESET, K = "kimi-k3-tiny", 3
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=6)
PROMPTS = [list(range(20, 57)), [(7 * i + 3) % 250 for i in range(11)], [(11 * i + 5) % 250 for i in range(13)]]
MAX_TOKENS = 14
SCRIPTED = (0, 1)  # prompts whose drafts are plain decoding's outputs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    model_dir = tiny_checkpoints[PRESET]
    drafter = make_checkpoint("kimi-k3-tiny-hidden", tmp_path_factory.mktemp("hidden") / "drafter", seed=3)
    spec = SpeculativeConfig(method="hidden", draft_model=drafter, num_draft_tokens=K)
    plain = [r.token_ids for r in LLM(model_dir, cache=CACHE).generate(PROMPTS, greedy(MAX_TOKENS))]
    script = {tuple(PROMPTS[i]): plain[i] for i in SCRIPTED}
    aggregated = LLM(model_dir, cache=CACHE, speculative=spec)
    proposals = record_drafts(aggregated.engine, script)
    tokens = [r.token_ids for r in aggregated.generate(PROMPTS, greedy(MAX_TOKENS))]
    return {"model_dir": model_dir, "spec": spec, "script": script, "proposals": proposals, "tokens": tokens,
            "stats": aggregated.engine.spec_stats}


def _ctx_prefills(ctx: EngineCore) -> dict[str, list[int]]:
    """Each prompt prefilled on ``ctx`` with its cache held: request id -> its first token."""
    for i, prompt in enumerate(PROMPTS):
        ctx.add_request(f"r{i}", prompt, greedy(1), hold_cache=True)
    first: dict[str, list[int]] = {}
    while ctx.has_unfinished_requests():
        for update in ctx.step():
            first.setdefault(update.request_id, []).append(update.token_id)
    return first


def _gen_run(setup, tmp_path, layout, ticket_layout, sender: KVSender, first: dict[str, list[int]]) -> dict:
    """The prompts received from ``sender`` and decoded by a world of one (its leader drafting)."""
    groups = init_parallel(Mapping(1, 0, dp=1, cp=1), f"file://{tmp_path}/init", backend="gloo", timeout_s=60)
    try:
        receiver = KVReceiver(TransceiverConfig(kv_transfer_timeout_ms=5000), layout)
        core = build_rank(setup["model_dir"], groups, WorldOptions(cache=CACHE, speculative=setup["spec"]), receiver)
        assert isinstance(core, EngineCore)
        proposals = record_drafts(core, setup["script"])
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            ticket = KVTicket(rid, sender.endpoint, ticket_layout, len(prompt), tuple(first[rid]))
            core.add_request(rid, prompt, greedy(MAX_TOKENS), forced_output_token_ids=first[rid], kv_ticket=ticket)
        tokens: dict[str, list[int]] = {}
        end = time.monotonic() + 60
        while core.has_unfinished_requests():
            assert time.monotonic() < end, "the gen engine did not finish"
            for update in core.step():
                assert update.error is None, update.error
                tokens.setdefault(update.request_id, []).append(update.token_id)
        assert core.draft_runner is not None and core.draft_runner.prompt_cache is not None
        left = (core.cache_manager.num_requests, len(core.draft_runner._seqs), set(core.draft_runner.prompt_cache.received))
        receiver.close()
        return {"proposals": proposals, "tokens": [tokens[f"r{i}"] for i in range(len(PROMPTS))],
                "stats": core.spec_stats, "left": left}
    finally:
        groups.destroy()


@pytest.fixture(scope="module")
def disaggregated(setup, tmp_path_factory):
    """The gen runs of both kinds: with the ctx's drafter cache, and with a ticket naming none."""
    ctx = LLM(setup["model_dir"], cache=CACHE, speculative=setup["spec"]).engine
    layout = kv_layout(ctx, ctx.model_config, "tiny", setup["spec"])
    assert layout.draft == drafter_prompt_layout(setup["spec"], torch.float32) and layout.draft is not None
    freed: list[str] = []
    sender = KVSender(TransceiverConfig(kv_transfer_timeout_ms=5000), layout, ctx.transfer_caches, freed.append)
    sender.start()
    runs = {}
    try:
        for name, ticket_layout in (("sent", layout), ("rebuilt", layout.model_copy(update={"draft": None}))):
            first = _ctx_prefills(ctx)
            for rid, tokens in first.items():
                sender.hold(rid, ctx.cache_manager.get(rid), len(PROMPTS[int(rid[1:])]), tokens)
            runs[name] = _gen_run(setup, tmp_path_factory.mktemp(name), layout, ticket_layout, sender, first)
            end = time.monotonic() + 10
            while len(freed) < len(PROMPTS) * len(runs):  # every gen rank acknowledged
                assert time.monotonic() < end, f"ctx freed only {freed}"
                time.sleep(0.01)
            for rid in first:
                ctx.release(rid)
    finally:
        sender.stop()
    runs["ctx_left"] = ctx.cache_manager.num_requests
    return runs


def test_the_gen_drafts_as_the_aggregated_engine_with_the_ctxs_drafter_cache(disaggregated, setup):
    sent = disaggregated["sent"]
    assert sent["proposals"] == setup["proposals"] and len(sent["proposals"]) > 10  # every draft, step by step
    assert sent["tokens"] == setup["tokens"]
    assert sent["stats"] == setup["stats"]
    assert 0 < sent["stats"].num_accepted_tokens < sent["stats"].num_draft_tokens


def test_a_gen_whose_ctx_sends_no_drafter_cache_rebuilds_it_and_drafts_otherwise(disaggregated, setup):
    rebuilt = disaggregated["rebuilt"]
    assert rebuilt["tokens"] == setup["tokens"]  # verified: the answer is exact all the same
    assert rebuilt["proposals"].keys() == setup["proposals"].keys()
    assert rebuilt["proposals"] != setup["proposals"]


def test_nothing_stays_allocated(disaggregated):
    for name in ("sent", "rebuilt"):
        assert disaggregated[name]["left"] == (0, 0, set())
    assert disaggregated["ctx_left"] == 0
