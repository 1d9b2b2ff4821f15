"""Start-up memory check of one engine rank (the arithmetic is :mod:`helixserve.planning.memory`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.models.config import KimiModelConfig
from helixserve.planning.memory import GIB, PoolBytes, draft_unit_bytes, pool_unit_bytes, rank_memory
from helixserve.planning.weights import WeightBytes, rank_weight_bytes


class _Sizes(Protocol):
    num_blocks: int
    num_slots: int
    num_checkpoint_slots: int


def check_rank_memory(model: torch.nn.Module, cache: CacheConfig, scheduler: SchedulerConfig, layout: _Sizes,
                      device: torch.device | str, dp: int = 1, cp: int = 1, use_cuda_graphs: bool = True,
                      draft: KimiModelConfig | None = None, draft_extra_params: int = 0, draft_tp: int = 1,
                      draft_slot_features: int = 0) -> None:
    """Refuse a rank whose weights + pools + activations + graph pools exceed one GPU
    (:class:`~helixserve.planning.memory.DeploymentDoesNotFitError` naming the shortfall):
    ``cache.gpu_memory_gib``, else on CUDA the device's total memory; on the CPU without it,
    no check. The same arithmetic as ``helixserve plan``; a ``draft`` model's weights (in its
    checkpoint's expert format, plus ``draft_extra_params`` outside its Kimi layers: a hidden
    drafter's input projections and norms) and pools (the target's counts, ``cp`` pages a block,
    ``H / draft_tp`` KDA heads a slot, ``draft_slot_features`` values a slot: a hidden drafter's
    feature row; its heads' weights split over ``draft_tp`` ranks) are counted with the target's."""
    is_cuda = torch.device(device).type == "cuda"
    if cache.gpu_memory_gib is not None:
        gpu_bytes = int(cache.gpu_memory_gib * GIB)
    elif is_cuda:
        gpu_bytes = torch.cuda.mem_get_info(torch.device(device))[1]
    else:
        return
    is_packed = any(t.dtype == torch.uint8 for t in (*model.parameters(), *model.buffers()))
    cfg, itemsize = model.cfg, model.dtype.itemsize
    block, slot = pool_unit_bytes(cfg, itemsize, cache.tokens_per_block, cp)
    if draft is not None:
        draft_block, draft_slot = draft_unit_bytes(draft, itemsize, cache.tokens_per_block, cp, draft_tp)
        block, slot = block + draft_block, slot + draft_slot + draft_slot_features * itemsize
    pools = PoolBytes(block, slot, layout.num_blocks,
                      layout.num_slots, scratch_slots=int(is_cuda), checkpoint_slots=layout.num_checkpoint_slots)
    batched = max(scheduler.max_num_batched_tokens, cache.max_num_seqs)
    memory = rank_memory(cfg, "gen world" if dp * cp > 1 else "engine", dp, cp, itemsize, pools, batched,
                         cache.max_num_seqs, is_cuda and use_cuda_graphs, gpu_bytes, "mxfp4" if is_packed else "dense")
    if draft is not None:
        weights = rank_weight_bytes(draft, itemsize, cp=draft_tp, heads_tp=draft_tp > 1)
        weights = replace(weights, dense_bytes=weights.dense_bytes + draft_extra_params * itemsize,
                          params={**weights.params, "inputs": draft_extra_params})
        memory = replace(memory, weights=_plus(memory.weights, weights))
    memory.check()


def _plus(weights: WeightBytes, draft: WeightBytes) -> WeightBytes:
    """The target's and the draft model's weights together (the target's expert format named)."""
    return WeightBytes(weights.dense_bytes + draft.dense_bytes, weights.fp32_bytes + draft.fp32_bytes,
                       weights.expert_bytes + draft.expert_bytes, weights.expert_format,
                       {**{f"draft {k}": v for k, v in draft.params.items()}, **weights.params})
