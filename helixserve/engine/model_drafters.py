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

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.draft_runner import DraftPages, DraftRunner, DraftWork, build_draft_runner
from helixserve.engine.hidden_runner import HiddenDraftRunner, build_hidden_runner
from helixserve.engine.hidden_work import HiddenWork
from helixserve.engine.rank_setup import CacheSizes
from helixserve.models.hidden_drafter_config import read_hidden_drafter_config
from helixserve.parallel import ParallelGroups
from helixserve.planning.drafter import Drafter

ModelDrafter = DraftRunner | HiddenDraftRunner
ModelDrafterWork = DraftWork | HiddenWork  # what a heads-TP drafter's leader sends its group


def build_model_drafter(speculative: SpeculativeConfig | None, drafter: Drafter | None, dtype: torch.dtype,
                        layout: CacheSizes, device: torch.device | str, pages: DraftPages | None,
                        cp: int = 1, groups: ParallelGroups | None = None) -> ModelDrafter | None:
    """The ``drafter`` (``speculative``'s, resolved and checked by
    :func:`~helixserve.planning.drafter.resolve_drafter`) loaded beside the target (``None``:
    none); ``pages``: the engine's cache manager (the drafter's full-row page tables,
    :mod:`.draft_runner`; ``None`` on a heads-TP drafter's follower); ``groups``: a world rank's
    (a heads-TP drafter's group)."""
    if speculative is None or drafter is None:
        return None
    if drafter.method == "hidden":
        return build_hidden_runner(speculative, drafter.cfg, dtype, layout, device, pages, cp, groups)
    return build_draft_runner(speculative, drafter.cfg, dtype, layout, device, pages, cp, groups)


def drafter_capture_layers(speculative: SpeculativeConfig | None) -> tuple[int, ...] | None:
    """The target layers whose outputs every forward keeps for the drafter (a hidden drafter's
    ``hidden_layers``; ``None``: none). A world's followers keep them too, so that the forward's
    gather of the token-sliced ones (:mod:`helixserve.models.hidden_capture`) runs on every rank of
    the CP group and the rows keep one order there."""
    if speculative is None or speculative.method != "hidden":
        return None
    assert speculative.draft_model is not None
    return read_hidden_drafter_config(speculative.draft_model)[1].hidden_layers
