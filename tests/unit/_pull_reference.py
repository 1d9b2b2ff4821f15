"""The per-segment memory map and AUX encoding as they were before the fast path
(`transceiver.memory_map`): the reference the tests hold them to."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from helixserve.cache_layout import ModelCaches
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.cache_check import _checked
from helixserve.transceiver.layout import AUX_MAGIC, AUX_WORDS, Segment, SegmentMemory, ShardSpec


def reference_memory(spec: ShardSpec, segments: Sequence[Segment], caches: ModelCaches, aux: torch.Tensor,
                     physical_blocks: Sequence[int], slot: int | None, num_heads: int,
                     head0: int) -> list[SegmentMemory]:
    lay = spec.layout
    k = lay.kda_head_dim
    out = []
    block_runs: dict[tuple, SegmentMemory] = {}
    for seg in segments:
        if seg.kind is PayloadKind.AUX:
            out.append(SegmentMemory.of(aux, [0], seg.unit_bytes))
            continue
        if seg.kind is PayloadKind.KV_BLOCKS:
            pool = _checked(caches.mla_kv, seg.layer_id, lay.kv_dtype,
                            (lay.tokens_per_block, lay.kv_lora_rank + lay.qk_rope_head_dim))
            key = (tuple(pool.shape), pool.stride(), pool.element_size(), seg.unit_bytes)
            shared = block_runs.get(key)
            if shared is None and pool.is_contiguous():
                row = pool.stride(0) * pool.element_size()
                offsets = np.asarray(physical_blocks, dtype=np.int64) * row
                shared = block_runs[key] = SegmentMemory.of(pool, offsets, seg.unit_bytes)
                out.append(shared)
            elif shared is None:
                out.append(SegmentMemory.of(pool, [], seg.unit_bytes))  # raises: not contiguous
            else:
                out.append(SegmentMemory(pool.reshape(-1).view(torch.uint8), shared.runs, shared.starts))
            continue
        if slot is None:
            raise ValueError(f"KDA layer {seg.layer_id} needs a state slot")
        if seg.kind is PayloadKind.KDA_STATE:
            pool = _checked(caches.kda_state, seg.layer_id, lay.state_dtype, (num_heads, k, k))
            offsets = [(slot * pool.stride(0) + head0 * pool.stride(1)) * pool.element_size()]
        else:
            pool = _checked(caches.conv_state, seg.layer_id, lay.conv_dtype,
                            (3 * num_heads * k, lay.conv_kernel_size - 1))
            offsets = [(slot * pool.stride(0) + (s * num_heads * k + head0 * k) * pool.stride(1))
                       * pool.element_size() for s in range(3)]
        out.append(SegmentMemory.of(pool, offsets, seg.unit_bytes))
    assert all(m.starts[-1] + m.runs[-1][1] == s.nbytes for m, s in zip(out, segments) if m.runs)
    return out


def reference_aux(num_prompt_tokens: int, first_tokens: Sequence[int]) -> torch.Tensor:
    aux = torch.zeros(AUX_WORDS, dtype=torch.int64)
    aux[:3] = torch.tensor([AUX_MAGIC, num_prompt_tokens, len(first_tokens)])
    aux[3 : 3 + len(first_tokens)] = torch.tensor(list(first_tokens))
    return aux
