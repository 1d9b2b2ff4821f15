"""What every rank of an engine sets up at start, alike on every rank of a world: its cache
layout (sizes from the budget through :mod:`helixserve.planning`, ``H / cp`` KDA heads), its cache
tensors, the token budget of a step and the shape of its decode CUDA graphs (and why it captures
none). Used by :class:`~helixserve.engine.core.EngineCore` (leaders, single processes) and by the
followers of a gen world (:func:`~helixserve.engine.world_rank.build_rank`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helixserve.cache_layout import CacheSpec, ModelCaches, cache_spec_for
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.kernels.triton_common import has_fla
from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.kvcache.group_prefix import GroupPrefixCacheManager
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.kvcache.prefix_events import PrefixEventLog
from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager
from helixserve.models.config import KimiModelConfig
from helixserve.planning.drafter import Drafter
from helixserve.planning.memory import checkpoint_slot_count, engine_pool_sizes, pool_unit_bytes


@dataclass(slots=True, frozen=True)
class CacheSizes:
    """Derived once at start-up from the cache config and the model."""

    num_blocks: int
    num_slots: int
    tokens_per_block: int
    max_model_len: int
    num_checkpoint_slots: int = 0  # KDA state checkpoints (prefix caching)


def size_cache(model_config: KimiModelConfig, dtype: torch.dtype, cache: CacheConfig, cp: int = 1,
               drafter: Drafter | None = None) -> tuple[CacheSpec, CacheSizes]:
    """One rank's cache layout: its spec (``H / cp`` KDA heads) and sizes from the budget. A CP
    group holds ``cp`` times one rank's blocks, so its ``max_model_len`` is ``cp`` times longer.
    With prefix caching every rank holds the group's state checkpoint slots (its head slice). A
    model ``drafter``'s pools (``cp`` pages a block, a slot a slot, :mod:`helixserve.engine.draft_runner`;
    ``H / drafter.tp`` KDA heads a slot; a hidden drafter's feature row a slot,
    :mod:`helixserve.planning.drafter`) come out of the same budget, on every rank of a CP group alike."""
    spec = cache_spec_for(model_config, dtype, cache.tokens_per_block, kda_num_heads=model_config.kda_num_heads // cp)
    slot_bytes = pool_unit_bytes(model_config, dtype.itemsize, cache.tokens_per_block, cp)[1]
    num_checkpoints = checkpoint_slot_count(cache, slot_bytes) if spec.kda_layer_ids else 0
    draft = {} if drafter is None else drafter.budget_args(dtype.itemsize)
    num_blocks, num_slots = engine_pool_sizes(model_config, dtype.itemsize, cache.tokens_per_block,
                                              cache.memory_budget_mib, cache.max_num_seqs, cp, num_checkpoints, **draft)
    max_model_len = min(cache.max_model_len or model_config.max_position_embeddings,
                        num_blocks * cache.tokens_per_block * cp)
    return spec, CacheSizes(num_blocks, num_slots, cache.tokens_per_block, max_model_len, num_checkpoints)


def allocate_rank_caches(spec: CacheSpec, layout: CacheSizes, device: torch.device | str) -> ModelCaches:
    """The cache tensors; on CUDA one slot more than the manager hands out: the scratch slot of
    padded CUDA-graph rows."""
    return allocate_model_caches(spec, layout.num_blocks, layout.num_slots + int(torch.device(device).type == "cuda"),
                                 device)


def make_cache_manager(cache: CacheConfig, spec: CacheSpec, layout: CacheSizes, cp: int
                       ) -> CacheManager | GroupCacheManager:
    """The leader's cache bookkeeping: a CP group's (``cp > 1``), else one rank's, reusing
    cached prefixes with ``cache.prefix_caching``."""
    has_mla, has_kda = bool(spec.mla_layer_ids), bool(spec.kda_layer_ids)
    if cp > 1 and cache.prefix_caching:
        return GroupPrefixCacheManager(layout.num_blocks, layout.num_slots, cache.tokens_per_block, cp,
                                       layout.num_checkpoint_slots, cache.state_checkpoint_blocks, has_mla, has_kda,
                                       PrefixEventLog(cache.prefix_events_capacity))
    if cp > 1:
        return GroupCacheManager(layout.num_blocks, layout.num_slots, cache.tokens_per_block, cp, has_mla, has_kda)
    if cache.prefix_caching:
        return PrefixCachingCacheManager(layout.num_blocks, layout.num_slots, cache.tokens_per_block,
                                         layout.num_checkpoint_slots, cache.state_checkpoint_blocks, has_mla, has_kda,
                                         PrefixEventLog(cache.prefix_events_capacity))
    return CacheManager(layout.num_blocks, layout.num_slots, cache.tokens_per_block, has_mla=has_mla, has_kda=has_kda)


def allocate_checkpoints(spec: CacheSpec, layout: CacheSizes, device: torch.device | str) -> ModelCaches | None:
    """The KDA state checkpoint pools of prefix caching (a state pool of ``num_checkpoint_slots``
    slots, no MLA blocks); ``None`` when there are none."""
    if not layout.num_checkpoint_slots:
        return None
    return allocate_model_caches(spec, 0, layout.num_checkpoint_slots, device)


def step_token_budget(cache: CacheConfig, scheduler: SchedulerConfig) -> int:
    """The most rows any step has: the scheduler's token budget, at least ``max_num_seqs`` (so
    every running decode fits one step; a decode graph's padded batch too)."""
    return max(scheduler.max_num_batched_tokens, cache.max_num_seqs)


def decode_graph_shape(cache: CacheConfig, layout: CacheSizes) -> tuple[int, int, int]:
    """``(max_batch, max_blocks, scratch_slot)`` of a rank's decode CUDA graphs: the same on every
    rank of a world (each sizes its cache alike), so every rank captures the same graphs."""
    return min(cache.max_num_seqs, layout.num_slots), -(-layout.max_model_len // cache.tokens_per_block), layout.num_slots


def decode_graphs_off_reason(model: torch.nn.Module, device: torch.device | str, use_cuda_graphs: bool,
                             world_size: int, capture_layers: tuple[int, ...] | None = None) -> str | None:
    """Why this rank captures no decode CUDA graphs (``None``: it captures them).

    Graphs need the fast kernels: the PyTorch references read metadata on the host and check slot
    ids (padded rows repeat the scratch slot), neither of which a graph can hold. In a world of
    more than one rank they need the hooks' static mode (no host read in the MoE all-to-all, the
    same shapes on every rank), which every rank of the world sets alike, so every rank captures
    (and replays) the same graphs, their collectives in the same order. Steps that keep layer
    outputs (``capture_layers``: a hidden-state drafter's) run eagerly."""
    if not use_cuda_graphs:
        return "enforce_eager"
    if capture_layers is not None:
        return f"a hidden-state drafter reads layers {list(capture_layers)} of every step"
    if torch.device(device).type != "cuda":
        return "not on CUDA"
    if not has_fla():
        return "the fast kernels (fla, Triton) are not in use"
    helix = getattr(model, "helix", None)
    if world_size > 1 and not (helix is not None and helix.is_static):
        return f"a world of {world_size} ranks without the static helix step (WorldOptions.static_moe)"
    return None
