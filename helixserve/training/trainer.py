"""A seeded next-token training loop for a small Kimi model, through the serving forward.

Each step samples ``batch_size`` windows of ``seq_len + 1`` tokens from the corpus stream (a
generator seeded with ``seed``), runs them as one prefill batch of the model's own forward
(:class:`~helixserve.models.kimi.KimiForCausalLM` over fresh caches), and takes an AdamW step on
the mean next-token cross-entropy: linear warm-up, then cosine decay to a tenth of ``lr``;
gradients clipped to ``max_grad_norm``; weight decay on matrices only. The MoE routers'
``e_score_correction_bias`` only steers expert choice (no gradient reaches it) and stays as
initialized.

The CPU kernels write some intermediates in place (the KDA chunk form reuses its buffers), which
autograd refuses; every tensor autograd saves is cloned when saved, so those writes do not
touch what the backward reads. Same seed, same corpus and same thread count: the same weights,
bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pydantic import Field

from helixserve.config_lifecycle import Strict
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.checkpoint import save_checkpoint
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.presets import get_preset, init_random_weights
from helixserve.models.tokenizer_hf import write_tokenizer_files
from helixserve.training.corpus import CorpusError, corpus_tokens

logger = logging.getLogger(__name__)

TRAINING_LOG = "training_log.json"
_TOKENS_PER_BLOCK = 16


class TrainingConfig(Strict):
    """Settings of one training run (``helixserve make-checkpoint --train-on``)."""

    steps: int = Field(300, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 0
    max_corpus_bytes: int = Field(8 << 20, ge=1)
    suffixes: tuple[str, ...] = (".py",)


@dataclass(slots=True)
class TrainingReport:
    """Per-step training loss, wall time, and the corpus's size in tokens."""

    losses: list[float]
    seconds: float
    num_corpus_tokens: int


def _lr_at(step: int, tc: TrainingConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: torch.nn.Module, tc: TrainingConfig) -> torch.optim.AdamW:
    for name, p in model.named_parameters():
        if name.endswith(".e_score_correction_bias"):
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95))


def step_loss(model: KimiForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``windows`` ``[B, L + 1]`` (one prefill of B sequences)."""
    num_seqs, length = windows.shape[0], windows.shape[1] - 1
    blocks_per_seq = -(-length // _TOKENS_PER_BLOCK)
    device = model.lm_head.weight.device
    caches = allocate_caches(model.cfg, num_seqs * blocks_per_seq, _TOKENS_PER_BLOCK, num_seqs,
                             dtype=model.dtype, device=device)
    chunks = [SeqChunk(row[:-1].tolist(), 0, slot) for slot, row in enumerate(windows)]
    batch = build_batch(chunks, _TOKENS_PER_BLOCK, blocks_per_seq, device=device)
    with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.clone, lambda saved: saved):
        logits = model(batch, caches)
    return torch.nn.functional.cross_entropy(logits, windows[:, 1:].reshape(-1).to(device))


def train(model: KimiForCausalLM, tokens: torch.Tensor, tc: TrainingConfig) -> list[float]:
    """Train ``model`` in place on the token stream ``tokens`` ``[N]``; the loss of every step."""
    if tokens.numel() < tc.seq_len + 2:
        raise CorpusError(f"the corpus has {tokens.numel()} tokens, fewer than seq_len + 2 = {tc.seq_len + 2}")
    if tc.seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len {tc.seq_len} exceeds the model's {model.cfg.max_position_embeddings} positions")
    gen = torch.Generator().manual_seed(tc.seed)
    optimizer = _optimizer(model, tc)
    offsets = torch.arange(tc.seq_len + 1)
    model.train()
    losses: list[float] = []
    for step in range(tc.steps):
        starts = torch.randint(0, tokens.numel() - tc.seq_len - 1, (tc.batch_size, 1), generator=gen)
        loss = step_loss(model, tokens[starts + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, tc)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == tc.steps - 1:
            logger.info("step %d/%d loss %.4f", step + 1, tc.steps, losses[-1])
    model.eval()
    return losses


def train_checkpoint(preset: str, out_dir: str | Path, train_on: str | Path, tc: TrainingConfig,
                     dtype: str = "float32") -> TrainingReport:
    """Train ``preset`` from its seeded random init on the text under ``train_on``; write the
    checkpoint (config, weights, byte-level tokenizer) and ``training_log.json`` to ``out_dir``."""
    cfg = get_preset(preset)
    if cfg.eos_token_id is None:
        raise ValueError(f"preset {preset!r} has no eos_token_id to separate the training files")
    tokens = corpus_tokens(train_on, tc.suffixes, tc.max_corpus_bytes, cfg.eos_token_id, tc.seed)
    if int(tokens.max()) >= cfg.vocab_size:
        raise ValueError(f"preset {preset!r}'s vocabulary ({cfg.vocab_size}) is smaller than the byte tokenizer's")
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, tc.seed)
    start = time.perf_counter()
    losses = train(model, tokens, tc)
    report = TrainingReport(losses, time.perf_counter() - start, int(tokens.numel()))
    out = save_checkpoint(model, cfg, out_dir, getattr(torch, dtype))
    write_tokenizer_files(out)
    log = {"preset": preset, "train_on": str(train_on), "config": tc.model_dump(), **asdict(report)}
    (out / TRAINING_LOG).write_text(json.dumps(log, indent=1))
    return report
