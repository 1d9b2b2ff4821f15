"""KDA state checkpoints taken inside a prefill chunk (prefix caching).

A prefill chunk covering checkpoint positions is not cut at them into steps: the step runs the
whole chunk through every layer, and only the KDA layers run its sequences in segments, split at
the checkpoint positions. Round ``r`` runs the ``r``-th segment of every sequence that has one
(one varlen short-conv and one chunked-KDA call), from the conv and recurrent states the round
before ended with; a segment that ends at a checkpoint position writes those states into the
checkpoint pools. A sequence without checkpoints is one segment, in round 0.

Each segment is computed exactly as a chunk ending at the checkpoint would be, and no row is
computed twice; the cost is one more conv + chunked-KDA call per layer per extra round, where a
cut chunk would cost a whole step (on a GPU, a step's fixed host work is what a short prefill
pays most for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve import kernels
from helixserve.cache_layout import ModelCaches


@dataclass(slots=True)
class SegmentRound:
    """One round: the batch sequences ``seq_index`` run their rows ``rows`` (segments in
    ``cu_seqlens``); those at ``save_at`` (indices into ``seq_index``) end at a checkpoint and
    write their states into ``checkpoints``."""

    seq_index: torch.Tensor
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    save_at: torch.Tensor
    checkpoints: torch.Tensor


@dataclass(slots=True)
class StateSaves:
    """A step's in-chunk checkpoints: its KDA segment rounds and the checkpoint pools."""

    rounds: list[SegmentRound]
    pools: ModelCaches


def build_state_saves(seqs: Sequence[tuple[int, int, Sequence[tuple[int, int]]]], pools: ModelCaches,
                      device: torch.device | str) -> StateSaves:
    """``seqs``: per batch sequence ``(first row in the batch, rows, ((offset, checkpoint), ...))``
    with offsets inside ``(0, rows)``, ascending."""
    cuts = [([0, *(o for o, _ in saves), n], [c for _, c in saves]) for _, n, saves in seqs]
    rounds = []
    for r in range(max(len(bounds) - 1 for bounds, _ in cuts)):
        index, rows, cu, save_at, checkpoints = [], [], [0], [], []
        for i, ((first, _, _), (bounds, ckpts)) in enumerate(zip(seqs, cuts)):
            if r + 1 >= len(bounds):
                continue
            if r < len(ckpts):
                save_at.append(len(index))
                checkpoints.append(ckpts[r])
            index.append(i)
            rows.extend(range(first + bounds[r], first + bounds[r + 1]))
            cu.append(len(rows))
        parts = (index, rows, cu, save_at, checkpoints)
        flat = torch.tensor([v for p in parts for v in p], dtype=torch.int64).to(device)
        rounds.append(SegmentRound(*flat.split_with_sizes([len(p) for p in parts])))
    return StateSaves(rounds, pools)


def segmented_prefill(mixer: torch.nn.Module, saves: StateSaves, qkv: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, conv_init: torch.Tensor, state_init: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked path of one KDA layer in segment rounds (module docstring): ``qkv`` the step's
    projections before the short conv, ``conv_init`` / ``state_init`` each batch sequence's
    initial states. Returns ``(o [T, H, K], conv_new [B, ...], state_new [B, ...])``."""
    H, K = mixer.num_heads, mixer.head_dim
    weight = mixer.conv_weight()
    conv, state = conv_init.clone(), state_init.clone()
    o: torch.Tensor | None = None
    conv_pool, state_pool = saves.pools.conv_state[mixer.layer_idx], saves.pools.kda_state[mixer.layer_idx]
    for rnd in saves.rounds:
        x, conv_at = kernels.short_conv_prefill(qkv.index_select(0, rnd.rows), weight,
                                                conv_state=conv.index_select(0, rnd.seq_index),
                                                cu_seqlens=rnd.cu_seqlens, activation="silu")
        n = rnd.rows.shape[0]
        q, k, v = (t.reshape(n, H, K) for t in x.split(H * K, dim=-1))
        out, state_at = kernels.kda_chunk_prefill(q, k, v, g.index_select(0, rnd.rows), beta.index_select(0, rnd.rows),
                                                  scale=K**-0.5, initial_state=state.index_select(0, rnd.seq_index),
                                                  cu_seqlens=rnd.cu_seqlens, use_qk_l2norm=True)
        if o is None:
            o = out.new_empty(qkv.shape[0], *out.shape[1:])
        o.index_copy_(0, rnd.rows, out)
        conv.index_copy_(0, rnd.seq_index, conv_at.to(conv.dtype))
        state.index_copy_(0, rnd.seq_index, state_at.to(state.dtype))
        if rnd.save_at.numel():
            conv_pool.index_copy_(0, rnd.checkpoints, conv_at.index_select(0, rnd.save_at).to(conv_pool.dtype))
            state_pool.index_copy_(0, rnd.checkpoints, state_at.index_select(0, rnd.save_at).to(state_pool.dtype))
    assert o is not None  # a step with saves has rows
    return o, conv, state
