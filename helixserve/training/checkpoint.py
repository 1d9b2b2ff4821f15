"""Trained checkpoints end to end (``helixserve make-checkpoint --preset NAME --train-on DIR``).

The target preset is trained from its seeded random init (:func:`~helixserve.models.presets.init_random_weights`)
on the text under ``DIR`` tokenized with the checkpoint's own tokenizer (the files of the chosen
format, loaded as a server loads them); then a draft preset (default
:data:`~helixserve.models.presets.DRAFT_PRESETS`: the target's two-layer cut) is trained on the
same text against the target (:mod:`.trainer`), and a hidden-state drafter preset (default
:data:`~helixserve.models.presets.HIDDEN_PRESETS`) teacher-forced on the target's hidden states
(:mod:`.hidden`). Each is written as a normal checkpoint (config, weights, the same tokenizer
files) with ``training_log.json``: the loss of every step, the held-out loss of the seeded init and
of the trained weights (the hidden drafter's: cross-entropy against the target's distribution),
and for a drafter the share of held-out positions where its greedy token is the target's.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from helixserve.models.checkpoint import save_checkpoint
from helixserve.models.config import KimiModelConfig
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.hidden_drafter import save_hidden_drafter
from helixserve.models.hidden_drafter_config import check_against_target
from helixserve.models.presets import (DRAFT_PRESETS, HIDDEN_PRESETS, check_tokenizer_format, get_preset,
                                       hidden_preset_config, init_random_weights, new_hidden_drafter,
                                       round_to_stored_format, write_tokenizer)
from helixserve.models.tokenizer_loader import load_tokenizer
from helixserve.training.corpus import Corpus, load_corpus
from helixserve.training.config import TrainingConfig
from helixserve.training.hidden import hidden_eval, train_hidden
from helixserve.training.trainer import eval_windows, greedy_agreement, held_out_loss, train

logger = logging.getLogger(__name__)

TRAINING_LOG = "training_log.json"
DRAFT_SUBDIR = "draft"
HIDDEN_SUBDIR = "hidden"
_TOKEN_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(slots=True)
class ModelReport:
    """One trained model: its loss per step, wall and process CPU time of the loop, held-out loss (None without held-out
    text) of the init and of the written weights, and (a draft) its greedy agreement with the target."""

    preset: str
    out_dir: str
    losses: list[float]
    seconds: float
    cpu_seconds: float
    held_out_loss_init: float | None
    held_out_loss: float | None
    greedy_agreement: float | None = None


@dataclass(slots=True)
class TrainingReport:
    target: ModelReport
    draft: ModelReport | None
    num_train_tokens: int
    num_held_out_tokens: int
    hidden: ModelReport | None = None


def default_draft_preset(preset: str) -> str | None:
    """The draft preset trained beside ``preset`` when none is named (None: no draft)."""
    return DRAFT_PRESETS.get(preset)


def default_hidden_preset(preset: str) -> str | None:
    """The hidden drafter preset trained beside ``preset`` when none is named (None: none)."""
    return HIDDEN_PRESETS.get(preset)


def _check_draft(preset: str, cfg: KimiModelConfig, draft_preset: str, draft_cfg: KimiModelConfig) -> None:
    for name in _TOKEN_FIELDS:
        if getattr(cfg, name) != getattr(draft_cfg, name):
            raise ValueError(f"draft preset {draft_preset!r} has {name} {getattr(draft_cfg, name)}, the target "
                             f"{preset!r} {getattr(cfg, name)}: a draft shares its target's vocabulary")


def _load_text(train_on: str | Path, cfg: KimiModelConfig, tc: TrainingConfig) -> Corpus:
    """The corpus in the tokenizer of format ``tc.tokenizer`` (written to a scratch dir and loaded from it)."""
    with tempfile.TemporaryDirectory(prefix="helixserve-tokenizer-") as scratch:
        write_tokenizer(scratch, tc.tokenizer, cfg)
        tok = load_tokenizer(scratch)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the {tc.tokenizer} tokenizer has {tok.vocab_size} tokens, "
                         f"more than vocab_size {cfg.vocab_size}")
    return load_corpus(train_on, tok, cfg.eos_token_id, tc)


def _fit(preset: str, out_dir: Path, corpus: Corpus, held_out: torch.Tensor | None, tc: TrainingConfig,
         steps: int, teacher: KimiForCausalLM | None = None) -> tuple[KimiForCausalLM, ModelReport]:
    """``preset`` from its seeded init, trained on ``corpus`` (see :func:`.trainer.train`)."""
    cfg = get_preset(preset)
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, tc.seed)
    model.eval()
    before = None if held_out is None else held_out_loss(model, held_out, tc.batch_size)
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = train(model, corpus.train, tc, steps, teacher)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    round_to_stored_format(model)
    after = None if held_out is None else held_out_loss(model, held_out, tc.batch_size)
    agreement = None if teacher is None or held_out is None else greedy_agreement(model, teacher, held_out,
                                                                                  tc.batch_size)
    logger.info("%s: %d steps in %.1f s (%.1f CPU s), held-out loss %s -> %s", preset, steps, seconds,
                cpu_seconds, before, after)
    return model, ModelReport(preset, str(out_dir), losses, seconds, cpu_seconds, before, after, agreement)


def _write(model: KimiForCausalLM, report: ModelReport, out_dir: Path, tc: TrainingConfig,
           extra: dict[str, Any]) -> None:
    out = save_checkpoint(model, model.cfg, out_dir, getattr(torch, tc.dtype))
    write_tokenizer(out, tc.tokenizer, model.cfg)
    (out / TRAINING_LOG).write_text(json.dumps({**asdict(report), **extra}, indent=1))


def _fit_hidden(preset: str, out_dir: Path, corpus: Corpus, held_out: torch.Tensor | None, tc: TrainingConfig,
                target: KimiForCausalLM) -> ModelReport:
    """Hidden drafter ``preset`` from its seeded init, trained against ``target`` and written."""
    drafter = new_hidden_drafter(preset, tc.seed)
    before = None if held_out is None else hidden_eval(drafter, target, held_out, tc.batch_size)[0]
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = train_hidden(drafter, target, corpus.train, tc, tc.draft_steps or tc.steps)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    after, agreement = (None, None) if held_out is None else hidden_eval(drafter, target, held_out, tc.batch_size)
    logger.info("%s: %d steps in %.1f s, held-out loss %s -> %s", preset, len(losses), seconds, before, after)
    out = save_hidden_drafter(drafter, out_dir, getattr(torch, tc.dtype))
    write_tokenizer(out, tc.tokenizer, target.cfg)
    return ModelReport(preset, str(out_dir), losses, seconds, cpu_seconds, before, after, agreement)


def train_checkpoint(preset: str, out_dir: str | Path, train_on: str | Path, tc: TrainingConfig,
                     draft_preset: str | None = None, draft_out: str | Path | None = None,
                     hidden_preset: str | None = None, hidden_out: str | Path | None = None) -> TrainingReport:
    """Train ``preset`` (and ``draft_preset`` and ``hidden_preset`` against it; None: none) on the
    text under ``train_on``; write the target to ``out_dir``, the draft to ``draft_out`` (default
    ``out_dir/draft``) and the hidden drafter to ``hidden_out`` (default ``out_dir/hidden``).
    Nothing is written when the text or the presets are refused."""
    cfg = get_preset(preset)
    check_tokenizer_format(tc.tokenizer, preset, cfg)
    if cfg.eos_token_id is None:
        raise ValueError(f"preset {preset!r} has no eos_token_id to separate the training files")
    if draft_preset is not None:
        _check_draft(preset, cfg, draft_preset, get_preset(draft_preset))
    if hidden_preset is not None:
        check_against_target(hidden_preset, *hidden_preset_config(hidden_preset), cfg)
    corpus = _load_text(train_on, cfg, tc)
    held_out = eval_windows(corpus.held_out, tc)
    if held_out is None:
        logger.warning("no held-out text under %s (%d tokens): no held-out loss", train_on, corpus.held_out.numel())
    extra = {"train_on": str(train_on), "config": tc.model_dump(),
             "num_train_tokens": int(corpus.train.numel()), "num_held_out_tokens": int(corpus.held_out.numel()),
             "held_out_files": corpus.held_out_files}
    out = Path(out_dir)
    target, target_report = _fit(preset, out, corpus, held_out, tc, tc.steps)
    _write(target, target_report, out, tc, extra)
    draft_report = None
    if draft_preset is not None:
        draft_dir = out / DRAFT_SUBDIR if draft_out is None else Path(draft_out)
        draft, draft_report = _fit(draft_preset, draft_dir, corpus, held_out, tc, tc.draft_steps or tc.steps, target)
        _write(draft, draft_report, draft_dir, tc, {**extra, "target_preset": preset})
    hidden_report = None
    if hidden_preset is not None:
        hidden_dir = out / HIDDEN_SUBDIR if hidden_out is None else Path(hidden_out)
        hidden_report = _fit_hidden(hidden_preset, hidden_dir, corpus, held_out, tc, target)
        (hidden_dir / TRAINING_LOG).write_text(json.dumps({**asdict(hidden_report), **extra,
                                                           "target_preset": preset}, indent=1))
    return TrainingReport(target_report, draft_report, int(corpus.train.numel()), int(corpus.held_out.numel()),
                          hidden_report)
