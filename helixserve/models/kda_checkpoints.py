"""KDA state checkpoints taken inside a prefill chunk (prefix caching).

A prefill chunk covering checkpoint positions is not cut at them: the step runs the whole chunk,
and each KDA layer also runs the chunk's first ``rows`` rows of every such sequence once more,
from the same initial conv and recurrent state, as a separate varlen batch (one short-conv and
one chunked-KDA call per layer, whatever the number of checkpoints), and writes the states it
ends with into the checkpoint pools. That is exactly what the chunk cut at the position would
have left in the slot, at the cost of recomputing those rows in the KDA layers only (no MLA,
MoE or extra step). A step's per-step host work is what a GPU prefill pays most for, so taking
the states in-step is cheaper than a step per checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve import kernels
from helixserve.cache_layout import ModelCaches


@dataclass(slots=True)
class StateSaves:
    """The in-step checkpoints of a step: save ``i`` is the state of batch sequence
    ``seq_index[i]`` after its rows ``rows[cu_seqlens[i]:cu_seqlens[i + 1]]``, into checkpoint
    ``checkpoints[i]`` of ``pools``."""

    seq_index: torch.Tensor
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    checkpoints: torch.Tensor
    pools: ModelCaches


def build_state_saves(saves: Sequence[tuple[int, int, int, int]], pools: ModelCaches,
                      device: torch.device | str) -> StateSaves:
    """``saves``: ``(batch sequence, its first row in the batch, rows, checkpoint)``."""
    rows = list(itertools.chain.from_iterable(range(first, first + n) for _, first, n, _ in saves))
    cu = list(itertools.accumulate((n for _, _, n, _ in saves), initial=0))
    flat = torch.tensor([s for s, *_ in saves] + rows + cu + [c for *_, c in saves], dtype=torch.int64)
    seq_index, rows_t, cu_t, checkpoints = flat.to(device).split_with_sizes([len(saves), len(rows), len(cu), len(saves)])
    return StateSaves(seq_index, rows_t, cu_t, checkpoints, pools)


def save_inner_states(mixer: torch.nn.Module, saves: StateSaves, qkv: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, conv_init: torch.Tensor, state_init: torch.Tensor) -> None:
    """Take layer ``mixer.layer_idx``'s in-step checkpoints (``qkv``: the step's projections
    before the short conv; ``conv_init`` / ``state_init``: each batch sequence's initial states)."""
    H, K = mixer.num_heads, mixer.head_dim
    rows = saves.rows
    x, conv_at = kernels.short_conv_prefill(qkv.index_select(0, rows), mixer.conv_weight(),
                                            conv_state=conv_init.index_select(0, saves.seq_index),
                                            cu_seqlens=saves.cu_seqlens, activation="silu")
    n = rows.shape[0]
    q, k, v = (t.reshape(n, H, K) for t in x.split(H * K, dim=-1))
    _, state_at = kernels.kda_chunk_prefill(q, k, v, g.index_select(0, rows), beta.index_select(0, rows),
                                            scale=K**-0.5, initial_state=state_init.index_select(0, saves.seq_index),
                                            cu_seqlens=saves.cu_seqlens, use_qk_l2norm=True)
    conv_pool, state_pool = saves.pools.conv_state[mixer.layer_idx], saves.pools.kda_state[mixer.layer_idx]
    conv_pool.index_copy_(0, saves.checkpoints, conv_at.to(conv_pool.dtype))
    state_pool.index_copy_(0, saves.checkpoints, state_at.to(state_pool.dtype))
