"""Settings of ``helixserve make-checkpoint --train-on`` (torch-free: the CLI reads its defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from helixserve.config_lifecycle import Strict


class TrainingConfig(Strict):
    """Settings of one training run (``helixserve make-checkpoint --train-on``) and of the
    checkpoints it writes (``tokenizer``: the files' format, see
    :func:`~helixserve.models.presets.write_tokenizer`; ``dtype``: the weights')."""

    steps: int = Field(300, ge=1)
    draft_steps: int | None = Field(None, ge=1, description="the draft's steps; None: steps")
    batch_size: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=1)
    lr: float = Field(6e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    distill_weight: float = Field(0.5, ge=0, le=1)
    seed: int = 0
    max_corpus_bytes: int = Field(4 << 20, ge=1)
    max_held_out_bytes: int = Field(256 << 10, ge=0)
    held_out_fraction: float = Field(0.05, ge=0, lt=1)
    eval_windows: int = Field(32, ge=1, description="held-out windows of seq_len + 1 tokens scored")
    log_every: int = Field(10, ge=1)
    suffixes: tuple[str, ...] = (".py",)
    tokenizer: Literal["hf", "kimi"] = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
