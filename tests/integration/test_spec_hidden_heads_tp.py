"""A hidden drafter's heads split over a CP group of 2 (``draft_tensor_parallel_size`` = cp; gloo,
CPU, the fp32 K3-tiny drafter), against the single-process drafter:

- each rank's drafter outputs and logits over the same rows and features equal the single
  process's (max abs difference small: only the o_proj sums are reordered);
- a prompt cache received on the leader (the drafter's pages and the feature row of the last
  prompt position, written there as the transceiver's receiver writes them) reaches the follower
  through the leader's announced prompt (the group's broadcast): its pages equal the leader's, and
  the group's drafts of the next verify steps (each step announced to the follower as a world's
  leader does, the target's features recorded on both) equal the single-process drafter's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helixserve.cache_layout import cache_spec_for
from helixserve.engine.draft_runner import full_row_caches
from helixserve.engine.hidden_runner import HiddenDraftRunner
from helixserve.engine.hidden_work import HiddenPrompt, HiddenStep
from helixserve.engine.rank_setup import CacheSizes
from helixserve.engine.request import Request
from helixserve.engine.runner import build_forward_batch
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.kvcache.manager import CacheManager
from helixserve.launch.processes import run_local_world
from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.hidden_drafter import HiddenDrafter, load_hidden_drafter
from helixserve.models.presets import make_checkpoint
from helixserve.parallel import Mapping, ParallelGroups, init_parallel

LAYOUT = CacheSizes(num_blocks=8, num_slots=2, tokens_per_block=4, max_model_len=32)
PROMPT = [(5 * i + 2) % 250 for i in range(9)]
K, NUM_STEPS = 3, 3


def _runner(model: HiddenDrafter, pages: CacheManager | None, groups: ParallelGroups | None = None
            ) -> HiddenDraftRunner:
    spec = cache_spec_for(model.cfg, torch.float32, LAYOUT.tokens_per_block, kda_num_heads=0)
    features = torch.zeros(LAYOUT.num_slots + 1, model.spec.feature_size)
    return HiddenDraftRunner(model, full_row_caches(spec, LAYOUT, 1, "cpu"), "cpu", pages, features, groups)


def _receive(runner: HiddenDraftRunner, pages: CacheManager) -> None:
    """Request ``r``'s drafter cache arrived: its pages and feature row written (seeded), marked."""
    request = Request("r", list(PROMPT), output_token_ids=[17], num_computed_tokens=len(PROMPT) + 1)
    slot = pages.allocate("r", len(PROMPT) + 1 + NUM_STEPS * (K + 1)).slot
    g = torch.Generator().manual_seed(1)
    for pool in runner.caches.mla_kv.values():
        for page in pages.full_row_table("r"):
            pool[page] = torch.randn(pool[page].shape, generator=g) * 0.5
    runner.slot_features[slot] = torch.randn(runner.num_features, generator=g)
    assert runner.prompt_cache is not None
    runner.prompt_cache.received.add("r")
    runner.prefill(request, chunk_tokens=8)


def _record(runner: HiddenDraftRunner, out: SchedulerOutput, step: int) -> None:
    """The target's forward of ``out``: seeded layer outputs, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    capture = HiddenCapture(runner.capture_layers or ())
    for layer in capture.layer_ids:
        capture.take(layer, torch.randn(out.num_tokens, runner.model.spec.target_hidden_size, generator=g))
    batch = build_forward_batch(out, "cpu")
    batch.hidden_capture = capture
    runner.record(out, batch)


def _lead(runner: HiddenDraftRunner, pages: CacheManager, is_group: bool) -> list[list[int]]:
    """Received prompt, then NUM_STEPS verify steps (one draft kept each); the drafts. ``is_group``:
    each drafted step goes to the follower too (a world leader's launch), for its record."""
    _receive(runner, pages)
    drafts, context, token = [], len(PROMPT) + 1, 17
    for step in range(NUM_STEPS):
        seq = ScheduledSeq("r", [token] + [0] * K, context, pages.full_row_table("r"), pages.get("r").slot,
                           is_prefill=False, sample=True, num_draft_tokens=K)
        out = SchedulerOutput(seqs=[seq])
        runner.propose(out)
        drafts.append(list(seq.token_ids[1:]))
        if is_group:
            dist.broadcast_object_list([out], src=0)
        _record(runner, out, step)
        context, token = context + 2, 30 + step
    return drafts


def _follow(runner: HiddenDraftRunner) -> dict:
    """The follower: the leader's prompt (its pages and feature row after it) and steps."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    prompt = box[0]
    assert isinstance(prompt, HiddenPrompt) and prompt.received and prompt.slot is not None
    runner.run_work(prompt)
    pool = next(iter(runner.caches.mla_kv.values()))
    got = {"pages": pool[prompt.block_table].tolist(), "feature_row": runner.slot_features[prompt.slot].tolist()}
    for step in range(NUM_STEPS):
        dist.broadcast_object_list(box, src=0)
        assert isinstance(box[0], HiddenStep)
        runner.run_work(box[0])
        dist.broadcast_object_list(box, src=0)  # the launched step, drafts filled
        _record(runner, box[0], step)
    return got


def _rank(rank: int, world_size: int, init_method: str, drafter_dir: str) -> dict:
    groups = init_parallel(Mapping(world_size, rank, dp=1, cp=world_size), init_method, backend="gloo",
                           timeout_s=60)
    try:
        model = load_hidden_drafter(drafter_dir, mapping=groups.mapping.for_draft_heads_tp()).bind(groups)
        single = load_hidden_drafter(drafter_dir)
        features = torch.randn(len(PROMPT), model.spec.feature_size, generator=torch.Generator().manual_seed(0))
        seq = ScheduledSeq("x", list(PROMPT), 0, [0, 1, 2], 0, is_prefill=True, sample=False)
        outputs = []
        for m in (model, single):
            hidden = m(build_forward_batch(SchedulerOutput(seqs=[seq]), "cpu"), _runner(m, None).caches, m.fuse(features))
            outputs.append((hidden, m.logits(hidden)))
        result = {"heads": model.model.layers[0].self_attn.num_heads,
                  "hidden_diff": (outputs[0][0] - outputs[1][0]).abs().max().item(),
                  "logits_diff": (outputs[0][1] - outputs[1][1]).abs().max().item(),
                  "logits_scale": outputs[1][1].abs().max().item()}
        if rank != 0:
            return result | _follow(_runner(model, None, groups))
        pages = CacheManager(LAYOUT.num_blocks, LAYOUT.num_slots, LAYOUT.tokens_per_block)
        leader = _runner(model, pages, groups)
        leader.announce = lambda work: dist.broadcast_object_list([work], src=0)
        drafts = _lead(leader, pages, is_group=True)
        pool = next(iter(leader.caches.mla_kv.values()))
        single_pages = CacheManager(LAYOUT.num_blocks, LAYOUT.num_slots, LAYOUT.tokens_per_block)
        received = {"pages": pool[pages.full_row_table("r")].tolist(),
                    "feature_row": leader.slot_features[pages.get("r").slot].tolist()}
        return result | {"drafts": drafts, "single_drafts": _lead(_runner(single, single_pages), single_pages, False),
                         "received": received}
    finally:
        groups.destroy()


def test_heads_tp_hidden_drafter_matches_the_single_process_drafter(tmp_path):
    drafter = make_checkpoint("kimi-k3-tiny-hidden", tmp_path / "drafter", seed=3)
    leader, follower = run_local_world(_rank, 2, str(drafter), timeout_s=120)
    for rank in (leader, follower):
        assert rank["heads"] * 2 == load_hidden_drafter(drafter).model.layers[0].self_attn.num_heads
        assert rank["hidden_diff"] < 1e-4 and rank["logits_diff"] < 1e-4 * max(1.0, rank["logits_scale"])
    # the received cache of the prompt's pages reached the follower (later rows rewrite later pages)
    prompt_pages = (len(PROMPT) + 1) // LAYOUT.tokens_per_block
    assert follower["pages"][:prompt_pages] == leader["received"]["pages"][:prompt_pages]
    assert follower["feature_row"] == leader["received"]["feature_row"]
    assert leader["drafts"] == leader["single_drafts"] and len(leader["drafts"]) == NUM_STEPS
