"""A hidden-state drafter's checkpoint config, read torch-free (:mod:`helixserve.models.hidden_drafter`
builds and loads the drafter): ``config.json`` is a Kimi config of the drafter's layers plus a
``hidden_drafter`` object (:class:`HiddenDrafterSpec`: the target layers it reads), and the checks
that it can read a given target. ``helixserve plan`` and the engine's memory check size a drafter
from here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from helixserve.models.config import KimiModelConfig

HIDDEN_DRAFTER_KEY = "hidden_drafter"


class HiddenDrafterSpec(BaseModel):
    """What a hidden drafter reads from its target (``config.json``'s ``hidden_drafter`` object)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_layers: tuple[int, ...] = Field(min_length=1, description="target decoder layers read (0-based)")
    target_hidden_size: int = Field(gt=0)

    @property
    def feature_size(self) -> int:
        """Target features a drafter row reads: its hidden layers' outputs side by side."""
        return len(self.hidden_layers) * self.target_hidden_size


class HiddenDrafterError(ValueError):
    """A hidden drafter checkpoint that cannot serve beside its target."""


def is_hidden_drafter(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` is a hidden drafter (its config has ``hidden_drafter``)."""
    config = Path(path) / "config.json"
    return config.is_file() and HIDDEN_DRAFTER_KEY in json.loads(config.read_text())


def read_hidden_drafter_config(path: str | Path) -> tuple[KimiModelConfig, HiddenDrafterSpec]:
    """The drafter's layer config and what it reads (:class:`HiddenDrafterError`: not a hidden drafter)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(config.read_text())
    if HIDDEN_DRAFTER_KEY not in raw:
        raise HiddenDrafterError(f"{path} is not a hidden-state drafter (its config.json has no "
                                 f"{HIDDEN_DRAFTER_KEY!r}); a draft model of the target's kind is method 'draft'")
    return hidden_drafter_config(raw)


def hidden_drafter_config(raw: dict[str, Any]) -> tuple[KimiModelConfig, HiddenDrafterSpec]:
    """Parse a hidden drafter's ``config.json`` dict (a preset's too); checks its own layers."""
    cfg = KimiModelConfig.from_hf_dict(raw)
    spec = HiddenDrafterSpec.model_validate(raw[HIDDEN_DRAFTER_KEY])
    if cfg.kda_layer_ids or cfg.moe_layer_ids or cfg.attn_res_block_size is not None:
        raise HiddenDrafterError("a hidden drafter's layers are MLA with a dense MLP and a plain residual stream; "
                                 f"this one has KDA layers {cfg.kda_layer_ids}, MoE layers {cfg.moe_layer_ids}, "
                                 f"attn_res_block_size {cfg.attn_res_block_size}")
    return cfg, spec


def check_against_target(path: str | Path, cfg: KimiModelConfig, spec: HiddenDrafterSpec,
                         target: KimiModelConfig) -> None:
    """:class:`HiddenDrafterError` naming both sides when the drafter cannot read ``target``: another
    vocabulary, another hidden size, or a layer the target does not have."""
    if cfg.vocab_size != target.vocab_size:
        raise HiddenDrafterError(f"hidden drafter {path} has vocab_size {cfg.vocab_size}, the target model has "
                                 f"vocab_size {target.vocab_size}: a drafter must share the target's vocabulary")
    if spec.target_hidden_size != target.hidden_size:
        raise HiddenDrafterError(f"hidden drafter {path} reads hidden states of size {spec.target_hidden_size}, the "
                                 f"target model's hidden_size is {target.hidden_size}")
    bad = [i for i in spec.hidden_layers if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise HiddenDrafterError(f"hidden drafter {path} reads target layers {list(spec.hidden_layers)}; the target "
                                 f"has {target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1}): "
                                 f"{bad} out of range")


def input_params(cfg: KimiModelConfig, spec: HiddenDrafterSpec) -> int:
    """Parameters of ``fc``, ``combine`` and the two input norms (what a Kimi model of ``cfg`` lacks)."""
    hidden = cfg.hidden_size
    return spec.feature_size * hidden + 2 * hidden * hidden + 2 * hidden
