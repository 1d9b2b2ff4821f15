"""The model drafter a role's ``speculative`` settings name, read torch-free from its checkpoint's
``config.json`` and checked against the target and the engine before any weight is read, and what
it costs the rank that holds it. The engine (:mod:`helixserve.engine.engine_parts`) and
``helixserve plan`` resolve it here, so both count the same bytes.

- ``ngram``: no drafter, nothing counted (:func:`resolve_drafter` gives ``None``).
- ``draft``: a draft model (:mod:`helixserve.engine.draft_runner`). On a CP group's leader (or a
  single process, a ctx worker): its whole weights; with ``draft_tensor_parallel_size`` = the
  world's ``cp``, every rank of the group holds its heads-TP share (:func:`rank_weight_bytes` with
  ``heads_tp``). Its pools: ``cp`` draft pages per target block (full rows) and one draft slot
  per slot, of ``H / draft_tp`` KDA heads (:func:`~helixserve.planning.memory.draft_unit_bytes`).
- ``hidden``: a hidden-state drafter (:mod:`helixserve.engine.hidden_runner`) on the leader, or
  with ``draft_tensor_parallel_size`` = ``cp`` its heads' share on every rank of the group: its
  Kimi layers' weights plus its input projections and norms (replicated)
  (:func:`~helixserve.models.hidden_drafter_config.input_params`); its MLA pages as a draft
  model's (no KDA state), and per slot one feature row of a prompt's last position
  (``feature_size`` values, ``num_slots + 1`` rows: the prompt cache a ctx worker sends).

Every rank of a group sizes its pools as its leader does (the drafter's share comes out of every
rank's budget alike, so capacity stays CP-uniform); the leader is the rank that holds the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from helixserve.config import CacheConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.models.config import KimiModelConfig
from helixserve.models.hidden_drafter_config import (HiddenDrafterError, HiddenDrafterSpec, check_against_target,
                                                     input_params, is_hidden_drafter, read_hidden_drafter_config)
from helixserve.planning.memory import PoolBytes, draft_unit_bytes
from helixserve.planning.weights import WeightBytes, rank_weight_bytes


class DraftModelError(ValueError):
    """A drafter that cannot serve beside its target (or is no checkpoint at all)."""


class DraftVocabMismatchError(DraftModelError):
    """The draft checkpoint's vocabulary is not the target's (both sizes named)."""

    def __init__(self, draft_model: Path, draft_vocab: int, target_vocab: int) -> None:
        super().__init__(f"speculative.draft_model {draft_model} has vocab_size {draft_vocab}, the target model "
                         f"has vocab_size {target_vocab}: a draft model must share the target's vocabulary")
        self.draft_vocab, self.target_vocab = draft_vocab, target_vocab


def _checkpoint_dir(speculative: SpeculativeConfig) -> Path:
    path = speculative.draft_model
    assert path is not None  # SpeculativeConfig requires it for methods draft and hidden
    if not (Path(path) / "config.json").is_file():
        raise DraftModelError(f"speculative.draft_model {path}: no config.json there (method "
                              f"{speculative.method!r} needs the drafter's checkpoint directory)")
    return Path(path)


def draft_config(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                 cache: CacheConfig) -> KimiModelConfig | None:
    """The draft checkpoint's config (``None``: no ``draft`` method), checked against the target's
    and the engine's before any weight is read (:class:`DraftModelError`)."""
    if speculative is None or speculative.method != "draft":
        return None
    path = _checkpoint_dir(speculative)
    if cache.prefix_caching:
        raise DraftModelError("speculative.method 'draft' does not run with cache.prefix_caching: the draft "
                              "model keeps no KDA state checkpoints of cached prefixes")
    if is_hidden_drafter(path):
        raise DraftModelError(f"speculative.draft_model {path} is a hidden-state drafter: use method 'hidden'")
    cfg = KimiModelConfig.from_pretrained(path)
    if cfg.vocab_size != target.vocab_size:
        raise DraftVocabMismatchError(path, cfg.vocab_size, target.vocab_size)
    for kind, draft_layers, target_layers in (("MLA", cfg.mla_layer_ids, target.mla_layer_ids),
                                              ("KDA", cfg.kda_layer_ids, target.kda_layer_ids)):
        if draft_layers and not target_layers:
            raise DraftModelError(f"speculative.draft_model {path} has {kind} layers and the target none: its "
                                  f"cache would have no {kind} pages or slots to share")
    return cfg


def hidden_config(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                  cache: CacheConfig) -> KimiModelConfig | None:
    """The hidden drafter's layer config (``None``: no ``hidden`` method), checked against the
    target's and the engine's before any weight is read (:class:`HiddenDrafterError`)."""
    checked = _checked_hidden(speculative, target, cache)
    return None if checked is None else checked[0]


def _checked_hidden(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                    cache: CacheConfig) -> tuple[KimiModelConfig, HiddenDrafterSpec] | None:
    """:func:`hidden_config`'s layer config and the drafter's spec, its ``config.json`` read once."""
    if speculative is None or speculative.method != "hidden":
        return None
    path = _checkpoint_dir(speculative)
    if cache.prefix_caching:
        raise HiddenDrafterError("speculative.method 'hidden' does not run with cache.prefix_caching: a cached "
                                 "prefix skips the target rows whose hidden states the drafter reads")
    cfg, spec = read_hidden_drafter_config(path)
    check_against_target(path, cfg, spec, target)
    return cfg, spec


def draft_tp_size(speculative: SpeculativeConfig | None) -> int:
    """Ranks a model drafter's heads are split over (a draft model's or a hidden drafter's; 1: it
    runs whole, on a CP group's leader)."""
    if speculative is None or speculative.method not in ("draft", "hidden"):
        return 1
    return speculative.draft_tensor_parallel_size


@dataclass(frozen=True, slots=True)
class Drafter:
    """A model drafter as the rank holding it pays for it: ``cfg`` its Kimi layers, ``tp`` the
    ranks its heads are split over, ``extra_params`` its parameters outside them (a hidden
    drafter's input projections and norms), ``slot_features`` the values of its feature row per
    slot (a hidden drafter's prompt cache; 0 for a draft model)."""

    method: str  # "draft" or "hidden"
    path: Path
    cfg: KimiModelConfig
    tp: int = 1
    extra_params: int = 0
    slot_features: int = 0

    def weight_bytes(self, itemsize: int) -> WeightBytes:
        """Its weights on a rank that holds it (its heads-TP share when ``tp > 1``), in its
        checkpoint's expert format; ``params["inputs"]``: ``extra_params``, where it has any."""
        weights = rank_weight_bytes(self.cfg, itemsize, cp=self.tp, heads_tp=self.tp > 1)
        if not self.extra_params:
            return weights
        return replace(weights, dense_bytes=weights.dense_bytes + self.extra_params * itemsize,
                       params={**weights.params, "inputs": self.extra_params})

    def slot_row_bytes(self, itemsize: int) -> int:
        """Bytes of its feature row per slot (a hidden drafter's prompt cache)."""
        return self.slot_features * itemsize

    def budget_args(self, itemsize: int) -> dict[str, Any]:
        """:func:`~helixserve.planning.memory.engine_pool_sizes`'s drafter arguments: what a block
        and a slot of every rank's budget pay for this drafter."""
        return {"draft": self.cfg, "draft_tp": self.tp, "draft_slot_bytes": self.slot_row_bytes(itemsize)}

    def pools(self, pools: PoolBytes, itemsize: int, tokens_per_block: int, cp: int) -> PoolBytes:
        """``pools`` (the target's, a rank of a CP group of ``cp``) with this drafter's beside them."""
        block, slot = draft_unit_bytes(self.cfg, itemsize, tokens_per_block, cp, self.tp)
        return replace(pools, draft_block_bytes=block, draft_slot_bytes=slot,
                       draft_row_bytes=self.slot_row_bytes(itemsize))


def resolve_drafter(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                    cache: CacheConfig) -> Drafter | None:
    """The model drafter ``speculative`` names (``None``: none, or ``ngram``), its config read and
    checked against ``target`` and ``cache`` (:class:`DraftModelError`,
    :class:`HiddenDrafterError`)."""
    if speculative is None or speculative.method == "ngram":
        return None
    if speculative.method == "draft":
        cfg = draft_config(speculative, target, cache)
        assert cfg is not None
        return Drafter("draft", Path(speculative.draft_model or ""), cfg, draft_tp_size(speculative))
    checked = _checked_hidden(speculative, target, cache)
    assert checked is not None and speculative.draft_model is not None
    cfg, spec = checked
    return Drafter("hidden", Path(speculative.draft_model), cfg, draft_tp_size(speculative), input_params(cfg, spec),
                   spec.feature_size)


def drafter_problems(drafter: Drafter, role: str, cp: int, context_len: int) -> list[str]:
    """Why a ``role`` rank of a CP group of ``cp`` (a ctx world's ``tp``) cannot run ``drafter``
    at ``context_len`` tokens, as the config and the engine refuse it (empty: it can)."""
    problems = []
    if role == "ctx" and cp > 1:
        problems.append(f"a ctx worker runs speculative decoding in one rank (ctx[].tp 1), not in a ctx world of "
                        f"tp {cp}")
    elif drafter.tp not in (1, cp):
        problems.append(f"speculative.draft_tensor_parallel_size={drafter.tp} must be 1 or the {role}'s cp={cp}")
    if context_len > drafter.cfg.max_position_embeddings:
        problems.append(f"context_len {context_len} exceeds the drafter's {drafter.cfg.max_position_embeddings} "
                        "positions")
    return problems
