"""A seeded next-token training loop for a small Kimi model, through the serving forward.

Each step samples ``batch_size`` windows of ``seq_len + 1`` tokens from the training stream (a
generator seeded with ``seed``), runs them as one prefill batch of the model's own forward
(:class:`~helixserve.models.kimi.KimiForCausalLM` over fresh caches: the CPU reference paths of
the KDA chunk form, MLA and the MoE, all differentiable), and takes an AdamW step on the mean
next-token cross-entropy: linear warm-up, then cosine decay to a tenth of ``lr``; gradients
clipped to ``max_grad_norm``; weight decay on matrices only. The MoE routers'
``e_score_correction_bias`` only steers expert choice (no gradient reaches it) and stays as
initialized.

With a ``teacher`` (a draft model trained against its target), the loss mixes in the
cross-entropy against the teacher's next-token distribution on the same windows, weighted
``distill_weight``: the draft learns what the target predicts, which is what speculative decoding
accepts.

The CPU kernels write some intermediates in place (the KDA chunk form reuses its buffers), which
autograd refuses; every tensor autograd saves is cloned when saved, so those writes do not
touch what the backward reads. Same seed, same corpus and same thread count: the same weights,
bit for bit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helixserve.cache_layout import ModelCaches
from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.kimi import KimiForCausalLM
from helixserve.training.config import TrainingConfig
from helixserve.training.corpus import CorpusError

logger = logging.getLogger(__name__)

_TOKENS_PER_BLOCK = 16


def lr_at(step: int, steps: int, tc: TrainingConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, steps - tc.warmup_steps)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, tc: TrainingConfig) -> torch.optim.AdamW:
    for name, p in model.named_parameters():
        if name.endswith(".e_score_correction_bias"):
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95))


def window_batch(cfg: KimiModelConfig, inputs: torch.Tensor, dtype: torch.dtype, device: torch.device
                 ) -> tuple[ForwardBatch, ModelCaches]:
    """``inputs`` ``[B, L]`` as one prefill of B sequences, over fresh caches of ``cfg``'s layers."""
    num_seqs, length = inputs.shape
    blocks_per_seq = -(-length // _TOKENS_PER_BLOCK)
    caches = allocate_caches(cfg, num_seqs * blocks_per_seq, _TOKENS_PER_BLOCK, num_seqs, dtype=dtype, device=device)
    chunks = [SeqChunk(row.tolist(), 0, slot) for slot, row in enumerate(inputs)]
    return build_batch(chunks, _TOKENS_PER_BLOCK, blocks_per_seq, device=device), caches


def run_saving_clones(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``forward()``, with every tensor autograd saves cloned when grad is on (see the module docstring)."""
    if not torch.is_grad_enabled():
        return forward()
    with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.clone, lambda saved: saved):
        return forward()


def window_logits(model: KimiForCausalLM, inputs: torch.Tensor, capture: HiddenCapture | None = None) -> torch.Tensor:
    """``[B * L, vocab]`` logits of ``inputs`` ``[B, L]`` (one prefill of B sequences); ``capture``
    keeps the outputs of its layers."""
    batch, caches = window_batch(model.cfg, inputs, model.dtype, model.lm_head.weight.device)
    batch.hidden_capture = capture
    return run_saving_clones(lambda: model(batch, caches))


def step_loss(model: KimiForCausalLM, windows: torch.Tensor, teacher: KimiForCausalLM | None = None,
              distill_weight: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy of ``windows`` ``[B, L + 1]``; with ``teacher``, mixed with
    ``distill_weight`` of the cross-entropy against the teacher's distribution."""
    logits = window_logits(model, windows[:, :-1])
    loss = F.cross_entropy(logits, windows[:, 1:].reshape(-1).to(logits.device))
    if teacher is None or distill_weight == 0:
        return loss
    with torch.no_grad():
        target = torch.softmax(window_logits(teacher, windows[:, :-1]).float(), dim=-1)
    soft = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    return (1 - distill_weight) * loss + distill_weight * soft


def train(model: KimiForCausalLM, tokens: torch.Tensor, tc: TrainingConfig, steps: int | None = None,
          teacher: KimiForCausalLM | None = None) -> list[float]:
    """Train ``model`` in place on the token stream ``tokens`` ``[N]`` for ``steps`` (default
    ``tc.steps``); the loss of every step."""
    steps = tc.steps if steps is None else steps
    if tokens.numel() < tc.seq_len + 2:
        raise CorpusError(f"the corpus has {tokens.numel()} tokens, fewer than seq_len + 2 = {tc.seq_len + 2}")
    if tc.seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len {tc.seq_len} exceeds the model's {model.cfg.max_position_embeddings} positions")
    gen = torch.Generator().manual_seed(tc.seed)
    optimizer = make_optimizer(model, tc)
    offsets = torch.arange(tc.seq_len + 1)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        starts = torch.randint(0, tokens.numel() - tc.seq_len - 1, (tc.batch_size, 1), generator=gen)
        loss = step_loss(model, tokens[starts + offsets], teacher, tc.distill_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, tc)
        optimizer.step()
        losses.append(loss.item())
        if step % tc.log_every == 0 or step == steps - 1:
            logger.info("step %d/%d loss %.4f", step + 1, steps, losses[-1])
    model.eval()
    return losses


def eval_windows(tokens: torch.Tensor, tc: TrainingConfig) -> torch.Tensor | None:
    """``[n, seq_len + 1]`` windows spread evenly over ``tokens`` (at most ``tc.eval_windows``,
    disjoint where the stream is long enough); None when it is shorter than one window."""
    span = tc.seq_len + 1
    if tokens.numel() < span:
        return None
    count = min(tc.eval_windows, tokens.numel() // span)
    starts = torch.linspace(0, tokens.numel() - span, count).long()
    return tokens[starts[:, None] + torch.arange(span)]


@torch.no_grad()
def held_out_loss(model: KimiForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy of ``model`` over ``windows`` ``[n, L + 1]``."""
    total = 0.0
    for s in range(0, windows.shape[0], batch_size):
        part = windows[s:s + batch_size]
        logits = window_logits(model, part[:, :-1])
        total += F.cross_entropy(logits, part[:, 1:].reshape(-1), reduction="sum").item()
    return total / (windows.shape[0] * (windows.shape[1] - 1))


@torch.no_grad()
def greedy_agreement(draft: KimiForCausalLM, target: KimiForCausalLM, windows: torch.Tensor,
                     batch_size: int) -> float:
    """Share of positions of ``windows`` where the draft's and the target's argmax tokens agree
    (what greedy speculative decoding accepts per drafted token, given the same prefix)."""
    agree = 0
    for s in range(0, windows.shape[0], batch_size):
        inputs = windows[s:s + batch_size, :-1]
        agree += int((window_logits(draft, inputs).argmax(-1) == window_logits(target, inputs).argmax(-1)).sum())
    return agree / (windows.shape[0] * (windows.shape[1] - 1))
