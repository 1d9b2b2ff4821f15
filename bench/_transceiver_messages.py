"""The transceiver bench's message counts: how many UCX messages one request is cut into, per
(ctx rank, gen rank) pair and in total, as both sides cut it (`layout.plan_messages` over the pair's
shard), and the same prompt over the preset's layers repeated 1, 2 and 4 times with each receiver's
default pack limit (`layout.default_pack_bytes`): on the host segments under `layout.ALONE_BYTES`
are packed (their count follows their bytes) and larger ones travel alone; on a GPU every segment
is packed (the count follows the bytes)."""

from __future__ import annotations

import torch

from helixserve.kvcache.helix import num_logical_blocks
from helixserve.models.presets import get_preset
from helixserve.protocol.disagg import KVLayout
from helixserve.transceiver.fan import sources
from helixserve.transceiver.layout import ALONE_BYTES, ShardSpec, layout_for, plan_messages, shard_segments

LAYER_REPEATS = (1, 2, 4)


def preset_layout(preset: str, tokens_per_block: int) -> KVLayout:
    return layout_for(get_preset(preset), torch.bfloat16, tokens_per_block, preset)


def pair_messages(layout: KVLayout, num_tokens: int, ctx_tp: int, gen_cp: int, message_bytes: int,
                  pack_bytes: int = ALONE_BYTES) -> list[int]:
    """Messages of each (ctx rank, gen rank) pair of one request, gen rank then ctx rank ascending."""
    world = layout.model_copy(update={"ctx_tp_size": ctx_tp, "ctx_rank": 0})
    blocks = num_logical_blocks(num_tokens, layout.tokens_per_block)
    counts = []
    for cp_rank in range(gen_cp):
        for src in sources(blocks, layout.num_kda_heads, ctx_tp, cp_rank, gen_cp):
            spec = ShardSpec(world, num_tokens, cp_rank, gen_cp, src.ctx_rank)
            counts.append(len(plan_messages(shard_segments(spec), message_bytes, pack_bytes)))
    return counts


def message_figures(layout: KVLayout, num_tokens: int, ctx_tp: int, gen_cp: int, message_bytes: int) -> dict:
    """``messages_per_pair`` (the most of any pair), ``messages_total`` and each pair's count."""
    counts = pair_messages(layout, num_tokens, ctx_tp, gen_cp, message_bytes)
    return {"messages_per_pair": max(counts), "messages_total": sum(counts), "pair_messages": counts}


def over_layers(layout: KVLayout, token_counts: list[int], message_bytes: int,
                gen_cps: tuple[int, ...] = (1, 4)) -> tuple[list[str], list[list], list[dict]]:
    """(headers, rows, records): the most messages of any (ctx rank, gen rank) pair of one request
    (from one ctx rank), with its shard's MiB, for each gen cp and prompt length, with the preset's
    layers repeated :data:`LAYER_REPEATS` times."""
    rows, records = [], []
    cases = [(cp, n) for cp in gen_cps for n in token_counts]
    for repeat in LAYER_REPEATS:
        deeper = layout.model_copy(update={"layer_kinds": list(layout.layer_kinds) * repeat})
        record = {"layers": len(deeper.layer_kinds), "cases": []}
        cells = []
        for cp, n in cases:
            host = max(pair_messages(deeper, n, 1, cp, message_bytes))
            gpu = max(pair_messages(deeper, n, 1, cp, message_bytes, message_bytes))
            nbytes = sum(seg.nbytes for seg in shard_segments(ShardSpec(deeper, n, 0, cp)))
            record["cases"].append({"gen_cp": cp, "tokens": n, "messages_per_pair": host,
                                    "messages_per_pair_gpu": gpu, "pair_bytes": nbytes})
            cells.append(f"{host} / {gpu} ({nbytes / 2**20:.0f} MiB)")
        rows.append([record["layers"], *cells])
        records.append(record)
    return ["layers", *(f"cp {cp}, {n} tokens: host / GPU" for cp, n in cases)], rows, records
