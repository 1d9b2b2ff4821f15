"""The drafters that are models, chosen by ``speculative.method``: ``draft`` (a draft model,
:mod:`.draft_runner`) and ``hidden`` (a hidden-state drafter, :mod:`.hidden_runner`). Both run
before each step's target forward, in a single process or on a world's CP group leader, their
caches on full rows named by the target's pages (either may instead run on every rank of the
group, its heads split: ``speculative.draft_tensor_parallel_size``, the leader announcing each
piece of work to the group first: ``announce``, followers ``run_work``); the engine drives either through the same calls
(``prefill`` of a prompt cache received from a ctx worker, ``propose`` before the forward,
``record`` after it, ``rollback`` after the verification, ``hold`` when a prefill's cache is held
for its gen worker, ``forget`` at a request's end); ``prompt_cache``: what of the drafter's cache
travels with a request (a hidden drafter's; none for a draft model)."""

from __future__ import annotations

import torch

from helixserve.config import CacheConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.draft_runner import DraftPages, DraftRunner, DraftWork, build_draft_runner, draft_config
from helixserve.engine.hidden_runner import HiddenDraftRunner, build_hidden_runner, hidden_config
from helixserve.engine.hidden_work import HiddenWork
from helixserve.engine.rank_setup import CacheSizes
from helixserve.models.config import KimiModelConfig
from helixserve.models.hidden_drafter import input_params, read_hidden_drafter_config
from helixserve.parallel import ParallelGroups

ModelDrafter = DraftRunner | HiddenDraftRunner
ModelDrafterWork = DraftWork | HiddenWork  # what a heads-TP drafter's leader sends its group


def drafter_config(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                   cache: CacheConfig) -> KimiModelConfig | None:
    """The drafter's layer config (its cache's shape; ``None``: no model drafter), checked against
    the target and the engine before any weight is read."""
    return draft_config(speculative, target, cache) or hidden_config(speculative, target, cache)


def build_model_drafter(speculative: SpeculativeConfig | None, cfg: KimiModelConfig | None, dtype: torch.dtype,
                        layout: CacheSizes, device: torch.device | str, pages: DraftPages | None,
                        cp: int = 1, groups: ParallelGroups | None = None) -> ModelDrafter | None:
    """The drafter of ``speculative.method`` loaded beside the target (``None``: none); ``pages``:
    the engine's cache manager (the drafter's full-row page tables, :mod:`.draft_runner`; ``None``
    on a heads-TP drafter's follower); ``groups``: a world rank's (a heads-TP drafter's group)."""
    if speculative is None or cfg is None:
        return None
    if speculative.method == "hidden":
        return build_hidden_runner(speculative, cfg, dtype, layout, device, pages, cp, groups)
    return build_draft_runner(speculative, cfg, dtype, layout, device, pages, cp, groups)


def drafter_extra_params(speculative: SpeculativeConfig | None, cfg: KimiModelConfig | None) -> int:
    """Parameters of the drafter outside its Kimi layers, embedding and LM head (a hidden
    drafter's input projections and norms; 0 for a draft model)."""
    if speculative is None or cfg is None or speculative.method != "hidden":
        return 0
    assert speculative.draft_model is not None
    return input_params(*read_hidden_drafter_config(speculative.draft_model))


def drafter_slot_features(speculative: SpeculativeConfig | None) -> int:
    """Values a cache slot holds for the drafter beside its pools: a hidden drafter's feature row
    of a prompt's last position (its prompt cache, :mod:`.hidden_runner`), 0 for the others."""
    if speculative is None or speculative.method != "hidden":
        return 0
    assert speculative.draft_model is not None
    return read_hidden_drafter_config(speculative.draft_model)[1].feature_size


def drafter_capture_layers(speculative: SpeculativeConfig | None) -> tuple[int, ...] | None:
    """The target layers whose outputs every forward keeps for the drafter (a hidden drafter's
    ``hidden_layers``; ``None``: none). A world's followers keep them too, so that the forward's
    gather of the token-sliced ones (:mod:`helixserve.models.hidden_capture`) runs on every rank of
    the CP group and the rows keep one order there."""
    if speculative is None or speculative.method != "hidden":
        return None
    assert speculative.draft_model is not None
    return read_hidden_drafter_config(speculative.draft_model)[1].hidden_layers
