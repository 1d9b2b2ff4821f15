"""helixserve.parallel: rank layout, process groups and collectives of the helix_a2a gen world.

- :mod:`.mapping`: :class:`Mapping` (dp x cp x tp ranks, ep = world, head/expert sharding).
- :mod:`.groups`: :func:`dist_env_from` (torchrun/srun variables), :func:`init_parallel`,
  :class:`ParallelGroups` (world, cp, dp, ep, cpu groups; every group has a timeout).
- :mod:`.row_split`: token slicing, ``c = ceil(T / cp)`` rows per CP rank.
- :mod:`.collectives`: all-gather / reduce-scatter rows, uneven all-to-all, helix LSE exchange,
  the all-reduce of a heads-TP drafter and its leader's broadcast of a received prompt cache.
- :mod:`.moe_a2a`: MoE dispatch/combine over the whole world with an expert callback.
- :mod:`.moe_padded`: the same with static shapes (padded all-to-all, per-rank capacity, no host
  read), for CUDA graphs; ``moe_a2a(..., capacity=int)`` picks it.

The names below load their module on first use (PEP 562), so ``import helixserve.parallel.mapping``
(the router's and config's layout arithmetic) stays torch-free; every other module needs torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULE_OF = {
    **dict.fromkeys(("CollectiveError", "LseBuffers", "all_gather_counts", "all_reduce_sum", "all_gather_rows", "all_to_all_equal",
                     "all_to_all_rows", "broadcast_from", "exchange_split_sizes", "lse_all_to_all", "lse_buffers",
                     "reduce_scatter_rows"), "collectives"),
    **dict.fromkeys(("DistEnv", "ParallelGroups", "dist_env_from", "init_from_env", "init_parallel"),
                    "groups"),
    "Mapping": "mapping",
    **dict.fromkeys(("MoeDispatch", "moe_a2a", "moe_combine", "moe_dispatch"), "moe_a2a"),
    **dict.fromkeys(("MoeCapacityError", "PaddedMoeDispatch", "moe_combine_padded", "moe_dispatch_padded",
                     "raise_if_overflow"), "moe_padded"),
    **dict.fromkeys(("RowSlice", "pad_rows", "per_rank_token_counts", "row_chunk", "rows_for_rank",
                     "split_rows", "valid_rows"), "row_split"),
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


if TYPE_CHECKING:
    from helixserve.parallel.collectives import (CollectiveError, LseBuffers, all_gather_counts, all_gather_rows,
                                                 all_reduce_sum, broadcast_from,
                                                 all_to_all_equal, all_to_all_rows, exchange_split_sizes,
                                                 lse_all_to_all, lse_buffers, reduce_scatter_rows)
    from helixserve.parallel.groups import DistEnv, ParallelGroups, dist_env_from, init_from_env, init_parallel
    from helixserve.parallel.mapping import Mapping
    from helixserve.parallel.moe_a2a import MoeDispatch, moe_a2a, moe_combine, moe_dispatch
    from helixserve.parallel.moe_padded import (MoeCapacityError, PaddedMoeDispatch, moe_combine_padded,
                                                moe_dispatch_padded, raise_if_overflow)
    from helixserve.parallel.row_split import (RowSlice, pad_rows, per_rank_token_counts, row_chunk,
                                               rows_for_rank, split_rows, valid_rows)

__all__ = [
    "CollectiveError", "DistEnv", "LseBuffers", "Mapping", "MoeCapacityError", "MoeDispatch",
    "PaddedMoeDispatch", "ParallelGroups", "RowSlice", "all_gather_counts", "all_gather_rows", "all_reduce_sum", "all_to_all_equal",
    "all_to_all_rows", "broadcast_from", "dist_env_from", "exchange_split_sizes", "init_from_env", "init_parallel",
    "lse_all_to_all", "lse_buffers", "moe_a2a", "moe_combine", "moe_combine_padded", "moe_dispatch",
    "moe_dispatch_padded", "raise_if_overflow", "pad_rows", "per_rank_token_counts", "reduce_scatter_rows",
    "row_chunk", "rows_for_rank", "split_rows", "valid_rows",
]
