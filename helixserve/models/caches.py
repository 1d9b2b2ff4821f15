"""Single-process cache allocation and batch building for tests and simple drivers.

Production cache pools and block tables come from :mod:`helixserve.kvcache`; these helpers give
each sequence contiguous physical blocks so a test can run the model without the cache manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch


def allocate_caches(
    cfg: KimiModelConfig, num_blocks: int, tokens_per_block: int, num_slots: int,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> ModelCaches:
    """Zeroed caches: MLA ``[num_blocks, tokens_per_block, kv_lora_rank + rope]`` (dtype), KDA state
    ``[num_slots, H, K, V]`` fp32, conv state ``[num_slots, 3*H*K, W-1]`` (dtype)."""
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    caches = ModelCaches(tokens_per_block=tokens_per_block)
    for i in cfg.mla_layer_ids:
        caches.mla_kv[i] = torch.zeros(num_blocks, tokens_per_block, cfg.mla_latent_dim, dtype=dtype, device=device)
    for i in cfg.kda_layer_ids:
        caches.kda_state[i] = torch.zeros(num_slots, H, K, K, dtype=torch.float32, device=device)
        caches.conv_state[i] = torch.zeros(num_slots, 3 * H * K, W - 1, dtype=dtype, device=device)
    return caches


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for one step."""

    token_ids: Sequence[int]
    context_len: int
    slot: int


def build_batch(
    chunks: Sequence[SeqChunk], tokens_per_block: int, blocks_per_seq: int,
    last_token_logits_only: bool = False, device: str | torch.device = "cpu",
) -> ForwardBatch:
    """Flat batch where the sequence in slot ``s`` owns physical blocks ``[s*blocks_per_seq, (s+1)*blocks_per_seq)``."""
    input_ids, positions, cu, last_rows = [], [], [0], []
    for c in chunks:
        n = len(c.token_ids)
        if c.context_len + n > tokens_per_block * blocks_per_seq:
            raise ValueError(
                f"sequence in slot {c.slot} needs {c.context_len + n} tokens, more than "
                f"{tokens_per_block * blocks_per_seq} = tokens_per_block * blocks_per_seq"
            )
        input_ids.extend(c.token_ids)
        positions.extend(range(c.context_len, c.context_len + n))
        cu.append(cu[-1] + n)
        last_rows.append(cu[-1] - 1)
    block_tables = torch.tensor(
        [[c.slot * blocks_per_seq + b for b in range(blocks_per_seq)] for c in chunks], dtype=torch.int32
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
        context_lens=torch.tensor([c.context_len for c in chunks], dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        state_slots=torch.tensor([c.slot for c in chunks], dtype=torch.int64, device=device),
        logits_indices=torch.tensor(last_rows, dtype=torch.int64, device=device) if last_token_logits_only else None,
    )


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, caches: ModelCaches, prompt_ids: Sequence[int], max_new_tokens: int,
    slot: int = 0, blocks_per_seq: int = 8,
) -> list[int]:
    """Prefill ``prompt_ids`` then decode greedily, one token per step (no stop tokens)."""
    tpb = caches.tokens_per_block
    batch = build_batch([SeqChunk(list(prompt_ids), 0, slot)], tpb, blocks_per_seq, last_token_logits_only=True)
    out = [int(model(batch, caches)[-1].argmax())]
    context = len(prompt_ids)
    while len(out) < max_new_tokens:
        batch = build_batch([SeqChunk([out[-1]], context, slot)], tpb, blocks_per_seq)
        out.append(int(model(batch, caches)[-1].argmax()))
        context += 1
    return out
