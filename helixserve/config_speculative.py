"""Speculative decoding settings of one role (``speculative:`` in a role's YAML block).

Torch-free, imports nothing of the package but the config base. Three drafters:

- ``ngram``: prompt lookup, no weights; the last ``prompt_lookup_max`` .. ``prompt_lookup_min``
  tokens are matched against earlier tokens of the same sequence;
- ``draft``: a smaller helixserve checkpoint with the target's vocabulary (``draft_model``), run
  beside the target in a single-process engine; in a gen world on each CP group's leader
  (``draft_tensor_parallel_size: 1``, the default) or on every rank of the group, its attention
  heads split over the group (``draft_tensor_parallel_size`` = the world's ``cp``);
- ``hidden``: a drafter reading the target's hidden states (EAGLE-3 class), ``draft_model`` is
  its checkpoint; it runs where ``draft`` does (``draft_tensor_parallel_size`` too).

Defaults are resolved here, once: an ``ngram`` config without window sizes gets vLLM's
(``prompt_lookup_min = prompt_lookup_max = 5`` when neither is given; the one given sets the
other otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from helixserve.config_lifecycle import Strict

SpeculativeMethod = Literal["ngram", "draft", "hidden"]
MAX_NUM_DRAFT_TOKENS = 7
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(Strict):
    """Draft ``num_draft_tokens`` tokens per sequence per step; the target verifies them in one
    forward (greedy acceptance, or exact rejection sampling at temperature > 0)."""

    method: SpeculativeMethod
    draft_model: Path | None = Field(None, description="drafter checkpoint (method draft or hidden)")
    num_draft_tokens: int = Field(3, ge=1, le=MAX_NUM_DRAFT_TOKENS,
                                  description="draft tokens per sequence per step")
    draft_tensor_parallel_size: int = Field(
        1, ge=1, description="method draft or hidden in a gen world: 1 runs the drafter on each CP group's "
                             "leader; the world's cp splits its attention heads over the CP group's ranks")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest suffix matched")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest suffix matched")

    @model_validator(mode="after")
    def _resolve(self) -> SpeculativeConfig:
        if self.draft_tensor_parallel_size != 1 and self.method == "ngram":
            raise ValueError("speculative.draft_tensor_parallel_size is for method draft or hidden, not 'ngram'")
        if self.method == "ngram":
            if self.draft_model is not None:
                raise ValueError(f"speculative.draft_model ({self.draft_model}) is for method draft or "
                                 "hidden; method ngram uses no weights")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if lo > hi:
                raise ValueError(f"speculative.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            # frozen model: fill the resolved values in place once
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            return self
        if self.draft_model is None:
            raise ValueError(f"speculative.method {self.method!r} needs draft_model (a checkpoint directory)")
        given = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, n) is not None]
        if given:
            raise ValueError(f"speculative.{given[0]} is for method ngram, not {self.method!r}")
        return self
