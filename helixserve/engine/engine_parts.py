"""What an engine's rank holds, built in the one order that works: the cache sized (a model
drafter's pools counted) and checked against the device, the pools, the model runner, the cache
manager, the model drafter (whose reads of the target decide whether steps may be graphed), the
CUDA graphs of decode steps (and, with speculation in a world of one, of verify steps and their
rollbacks), the KDA state checkpoints of prefix caching, and the caches a request's KV transfer
moves (with a hidden drafter's prompt cache). :mod:`.core` drives them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.draft_runner import draft_tp_size
from helixserve.engine.model_drafters import (ModelDrafter, build_model_drafter, drafter_config, drafter_extra_params,
                                              drafter_slot_features)
from helixserve.engine.rank_memory import check_rank_memory
from helixserve.engine.rank_setup import (CacheSizes, allocate_checkpoints, allocate_rank_caches, decode_graph_shape,
                                          decode_graphs_off_reason, make_cache_manager, size_cache)
from helixserve.engine.runner import ModelRunner
from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.kvcache.manager import CacheManager
from helixserve.models.config import KimiModelConfig
from helixserve.parallel import ParallelGroups

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """One engine's rank-side parts (:func:`build_engine_parts`)."""

    layout: CacheSizes
    caches: ModelCaches
    runner: ModelRunner
    cache_manager: CacheManager | GroupCacheManager  # a world's CP group's: GroupCacheManager
    draft_runner: ModelDrafter | None
    transfer_caches: ModelCaches  # `caches`, and a hidden drafter's prompt cache (``draft``) where it has one


def build_engine_parts(model: torch.nn.Module, model_config: KimiModelConfig, cache: CacheConfig,
                       scheduler: SchedulerConfig, device: torch.device | str, seed: int, use_cuda_graphs: bool,
                       speculative: SpeculativeConfig | None, cp: int, world_size: int,
                       groups: ParallelGroups | None = None) -> EngineParts:
    """One engine's parts on ``device`` (see the module docstring); ``cp`` and ``world_size``: its
    world's (1, 1 in a single process); ``groups``: a world leader's."""
    draft_cfg = drafter_config(speculative, model_config, cache)
    draft_tp = draft_tp_size(speculative)
    slot_features = drafter_slot_features(speculative)
    spec, layout = size_cache(model_config, model.dtype, cache, cp, draft_cfg, draft_tp, slot_features)
    check_rank_memory(model, cache, scheduler, layout, device, world_size // cp, cp, use_cuda_graphs,
                      draft_cfg, drafter_extra_params(speculative, draft_cfg), draft_tp, slot_features)
    caches = allocate_rank_caches(spec, layout, device)
    runner = ModelRunner(model, caches, device, seed=seed)
    cache_manager = make_cache_manager(cache, spec, layout, cp)
    draft_runner = build_model_drafter(speculative, draft_cfg, model.dtype, layout, device, cache_manager, cp,
                                       groups)
    if draft_runner is not None:
        runner.capture_layers = draft_runner.capture_layers
    graphs_off = decode_graphs_off_reason(model, device, use_cuda_graphs, world_size, runner.capture_layers)
    if graphs_off is None:
        runner.capture_decode_graphs(*decode_graph_shape(cache, layout))
        if speculative is not None and world_size == 1 and runner.decode_graphs is not None:
            runner.capture_verify_graphs(speculative.num_draft_tokens, *decode_graph_shape(cache, layout))
    elif torch.device(device).type == "cuda" and use_cuda_graphs:
        logger.info("decode CUDA graphs off: %s", graphs_off)
    if cache_manager.prefix_caching:
        runner.checkpoints = allocate_checkpoints(spec, layout, device)
    prompt_cache = draft_runner.prompt_cache if draft_runner is not None else None
    transfer_caches = replace(caches, draft=prompt_cache) if prompt_cache is not None else caches
    return EngineParts(layout, caches, runner, cache_manager, draft_runner, transfer_caches)
