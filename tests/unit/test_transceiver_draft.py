"""A hidden drafter's prompt cache in a shard (``KVLayout.draft``, the DRAFT payload): which
receiver takes it, which asks the two sides' layouts pair up on, and its bytes landing at the
gen leader's full-row pages and slot, through the stream's messages (the sender's gathered, the
receiver's scattered: no transport) and through a pull's unit copy (on the host, and on a GPU,
GPU-marked)."""

from __future__ import annotations

import pytest
import torch

from helixserve.cache_layout import DraftCaches, cache_spec_for
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol.disagg import DraftLayout
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.gen.pull import Pull, PullPair
from helixserve.transceiver.layout import ShardPlan, ShardSpec, layout_for, shard_segments
from helixserve.transceiver.layout_match import LayoutMismatchError, asked_layout, check_layout

CFG, DRAFTER = get_preset("kimi-k3-tiny"), get_preset("kimi-k3-tiny-hidden")  # the drafter: one MLA layer
TPB, FEATURES = 4, 3 * CFG.hidden_size
DRAFT = DraftLayout(model="drafter", num_layers=1, kv_lora_rank=DRAFTER.kv_lora_rank,
                    qk_rope_head_dim=DRAFTER.qk_rope_head_dim, feature_size=FEATURES, kv_dtype="float32")
LAYOUT = layout_for(CFG, torch.float32, TPB, "kimi-k3-tiny", DRAFT)
NUM_TOKENS = 23  # 6 blocks


def test_the_cp_groups_leader_alone_takes_the_drafter_cache_every_block_of_it():
    draft = [s for s in shard_segments(ShardSpec(LAYOUT, NUM_TOKENS, 0, 2)) if s.kind is PayloadKind.DRAFT]
    assert [(s.layer_id, s.num_units, s.unit_bytes) for s in draft] == [(0, 6, TPB * 40 * 4), (-1, 1, FEATURES * 4)]
    assert not any(s.kind is PayloadKind.DRAFT for s in shard_segments(ShardSpec(LAYOUT, NUM_TOKENS, 1, 2)))
    ctx_world = LAYOUT.model_copy(update={"ctx_tp_size": 2})  # a ctx world runs no drafter
    assert not ShardSpec(ctx_world, NUM_TOKENS, 0, 2).takes_draft
    assert not ShardSpec(LAYOUT.model_copy(update={"draft": None}), NUM_TOKENS, 0, 2).takes_draft


def test_a_ctx_refuses_an_ask_for_a_drafter_cache_it_does_not_hold_and_takes_one_for_none():
    other = LAYOUT.model_copy(update={"draft": DRAFT.model_copy(update={"model": "another"})})
    check_layout(LAYOUT, LAYOUT.model_copy(update={"draft": None}), "ctx", "gen", mapping=True)
    with pytest.raises(LayoutMismatchError, match="draft"):
        check_layout(LAYOUT, other, "ctx", "gen", mapping=True)
    check_layout(LAYOUT, other, "gen", "ctx")  # a gen rank checking a ticket: it falls back instead
    assert LAYOUT.mismatches(other) == []


def test_a_gen_rank_asks_for_the_drafter_cache_only_when_it_takes_it():
    bare = LAYOUT.model_copy(update={"draft": None})
    assert asked_layout(LAYOUT, LAYOUT, True).draft == DRAFT
    assert asked_layout(LAYOUT, LAYOUT, False).draft is None
    assert asked_layout(LAYOUT, bare, False) == bare


def _caches(device: str = "cpu"):
    """A ctx's caches and drafter cache (random), and a cp 2 leader's (zeros; the drafter on 2 x 16 pages)."""
    torch.manual_seed(0)
    ctx_caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB), 16, 4, device)
    gen_caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB, CFG.kda_num_heads // 2), 16, 4, device)
    for pool in ctx_caches.mla_kv.values():
        pool.normal_()
    draft_spec = cache_spec_for(DRAFTER, torch.float32, TPB)
    pools = [allocate_model_caches(draft_spec, 32, 0, device).mla_kv for _ in range(2)]
    for pool in pools[0].values():
        pool.normal_()
    ctx_caches.draft = DraftCaches(pools[0], torch.randn(5, FEATURES, device=device), lambda rid: [])
    gen_caches.draft = DraftCaches(pools[1], torch.zeros(5, FEATURES, device=device), lambda rid: [])
    return ctx_caches, gen_caches


CTX_BLOCKS, FULL_ROWS = [9, 3, 4, 11, 0, 7], [0, 16, 1, 17, 2, 18]  # the leader's cp 2 table: r * 16 + p


def _assert_landed(ctx_caches, gen_caches) -> None:
    for layer, pool in ctx_caches.draft.mla_kv.items():
        assert torch.equal(gen_caches.draft.mla_kv[layer][FULL_ROWS], pool[CTX_BLOCKS])
    assert torch.equal(gen_caches.draft.features[1], ctx_caches.draft.features[2])
    assert not gen_caches.draft.features[[0, 2, 3, 4]].any()


def test_the_drafter_cache_lands_at_the_leaders_full_row_pages_and_slot():
    ctx_caches, gen_caches = _caches()
    shard = ShardSpec(LAYOUT, NUM_TOKENS, 0, 2)
    sender = ShardPlan.for_sender(shard, ctx_caches, CTX_BLOCKS, 2, [7], 1 << 12)
    receiver = ShardPlan.for_receiver(shard, gen_caches, [5, 6, 8], 1, 1 << 12, draft_blocks=FULL_ROWS)
    assert receiver.messages == sender.messages
    for message in sender.messages:
        buffer = torch.empty(message.nbytes, dtype=torch.uint8)
        sender.gather(message, buffer)
        receiver.scatter(buffer, message)
    _assert_landed(ctx_caches, gen_caches)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_pull_out_of_the_ctxs_pools_copies_the_drafter_cache_too(device):
    ctx_caches, gen_caches = _caches(device)
    shard = ShardSpec(LAYOUT, NUM_TOKENS, 0, 2)
    pair = PullPair(LAYOUT, ctx_caches, gen_caches, CFG.kda_num_heads // 2)
    assert pair.moves_draft
    copy = Pull(pair, pair.groups(shard, CTX_BLOCKS, 2, [5, 6, 8], 1, FULL_ROWS), torch.device(device))
    assert copy.wait(10.0)  # (host memory: copied already)
    _assert_landed(ctx_caches, gen_caches)
    for layer, pool in ctx_caches.mla_kv.items():  # the target's blocks too (the leader's: even blocks)
        assert torch.equal(gen_caches.mla_kv[layer][[5, 6, 8]], pool[CTX_BLOCKS[0::2]])
    bare = ctx_caches.draft
    ctx_caches.draft = None  # a ctx exporting no drafter cache: the pull moves the target's only
    assert not PullPair(LAYOUT, ctx_caches, gen_caches, CFG.kda_num_heads // 2).moves_draft
    ctx_caches.draft = bare
