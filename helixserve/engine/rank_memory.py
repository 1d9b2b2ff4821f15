"""Start-up memory check of one engine rank (the arithmetic is :mod:`helixserve.planning.memory`)."""

from __future__ import annotations

from typing import Protocol

import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.planning.drafter import Drafter
from helixserve.planning.memory import GIB, PoolBytes, pool_unit_bytes, rank_memory


class _Sizes(Protocol):
    num_blocks: int
    num_slots: int
    num_checkpoint_slots: int


def check_rank_memory(model: torch.nn.Module, cache: CacheConfig, scheduler: SchedulerConfig, layout: _Sizes,
                      device: torch.device | str, dp: int = 1, cp: int = 1, use_cuda_graphs: bool = True,
                      drafter: Drafter | None = None) -> None:
    """Refuse a rank whose weights + pools + activations + graph pools exceed one GPU
    (:class:`~helixserve.planning.memory.DeploymentDoesNotFitError` naming the shortfall):
    ``cache.gpu_memory_gib``, else on CUDA the device's total memory; on the CPU without it,
    no check. The same arithmetic as ``helixserve plan``; a model ``drafter`` held on this rank
    (:mod:`helixserve.planning.drafter`: its weights, its heads-TP share over ``drafter.tp`` ranks,
    and its pools beside the target's) is counted with the target's."""
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
    pools = PoolBytes(block, slot, layout.num_blocks,
                      layout.num_slots, scratch_slots=int(is_cuda), checkpoint_slots=layout.num_checkpoint_slots)
    draft_weights = None
    if drafter is not None:
        pools = drafter.pools(pools, itemsize, cache.tokens_per_block, cp)
        draft_weights = drafter.weight_bytes(itemsize)
    batched = max(scheduler.max_num_batched_tokens, cache.max_num_seqs)
    memory = rank_memory(cfg, "gen world" if dp * cp > 1 else "engine", dp, cp, itemsize, pools, batched,
                         cache.max_num_seqs, is_cuda and use_cuda_graphs, gpu_bytes, "mxfp4" if is_packed else "dense",
                         draft_weights)
    memory.check()
