"""Training a hidden-state drafter (:mod:`helixserve.models.hidden_drafter`) against its target,
teacher-forced on the target's hidden states.

Each step samples windows as :func:`.trainer.train` does (same seeded generator), runs the frozen
target over them keeping the outputs of the drafter's ``hidden_layers`` (the serving forward,
``batch.hidden_capture``) and its next-token distribution, then the drafter over the same windows:
row ``i`` reads token ``x_i`` and the target's features at ``i - 1`` (zeros at the first row),
exactly what serving feeds it. A second pass feeds each row the drafter's own first-pass output of
the row before instead of the target's features (what a draft after the first reads, EAGLE-3's
training-time test, with plain causal attention over the second pass's rows). The loss is the
cross-entropy against the target's next-token distribution, the first pass weighted 1 and the
second 0.5. AdamW, the
learning-rate schedule and gradient clipping are the target's (:mod:`.trainer`). Same seed, corpus
and thread count: the same weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.hidden_drafter import HiddenDrafter
from helixserve.models.kimi import KimiForCausalLM
from helixserve.training.config import TrainingConfig
from helixserve.training.corpus import CorpusError
from helixserve.training.trainer import lr_at, make_optimizer, run_saving_clones, window_batch, window_logits

logger = logging.getLogger(__name__)

PASS_WEIGHTS = (1.0, 0.5)  # the target's features, then the drafter's own outputs


@torch.no_grad()
def target_features(target: KimiForCausalLM, layers: tuple[int, ...], inputs: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's features of ``inputs`` ``[B, L]`` (row ``i``: the target's layer outputs at
    ``i - 1``, zeros at ``i = 0``), ``[B * L, F]``, and the target's logits ``[B * L, vocab]``."""
    capture = HiddenCapture(layers)
    logits = window_logits(target, inputs, capture)
    num_seqs, length = inputs.shape
    feats = capture.features().view(num_seqs, length, -1)
    shifted = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)
    return shifted.reshape(num_seqs * length, -1), logits


def drafter_outputs(drafter: HiddenDrafter, inputs: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
    """The drafter's outputs ``[B * L, hidden]`` of ``inputs`` ``[B, L]`` read with ``fused`` features."""
    batch, caches = window_batch(drafter.cfg, inputs, drafter.dtype, drafter.lm_head.weight.device)
    return run_saving_clones(lambda: drafter(batch, caches, fused))


def _own_features(hidden: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Row ``i``'s second-pass feature: the first pass's output of row ``i - 1`` (zeros at row 0)."""
    h = hidden.view(num_seqs, -1, hidden.shape[-1])
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1).reshape(hidden.shape)


def hidden_step_loss(drafter: HiddenDrafter, target: KimiForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's next-token distribution, weighted over both passes (see
    the module docstring), of ``windows`` ``[B, L + 1]`` (the last token is not read)."""
    inputs = windows[:, :-1]
    features, target_logits = target_features(target, drafter.spec.hidden_layers, inputs)
    want = torch.softmax(target_logits.float(), dim=-1)
    fused = drafter.fuse(features)
    loss = torch.zeros((), device=fused.device)
    for weight in PASS_WEIGHTS:
        hidden = drafter_outputs(drafter, inputs, fused)
        loss = loss - weight * (want * F.log_softmax(drafter.logits(hidden), dim=-1)).sum(-1).mean()
        fused = _own_features(hidden, inputs.shape[0])
    return loss / sum(PASS_WEIGHTS)


def train_hidden(drafter: HiddenDrafter, target: KimiForCausalLM, tokens: torch.Tensor, tc: TrainingConfig,
                 steps: int) -> list[float]:
    """Train ``drafter`` in place against the frozen ``target`` on the token stream ``tokens``
    ``[N]``; the loss of every step."""
    if tokens.numel() < tc.seq_len + 2:
        raise CorpusError(f"the corpus has {tokens.numel()} tokens, fewer than seq_len + 2 = {tc.seq_len + 2}")
    gen = torch.Generator().manual_seed(tc.seed)
    optimizer = make_optimizer(drafter, tc)
    offsets = torch.arange(tc.seq_len + 1)
    target.eval()
    drafter.train()
    losses: list[float] = []
    for step in range(steps):
        starts = torch.randint(0, tokens.numel() - tc.seq_len - 1, (tc.batch_size, 1), generator=gen)
        loss = hidden_step_loss(drafter, target, tokens[starts + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, tc)
        optimizer.step()
        losses.append(loss.item())
        if step % tc.log_every == 0 or step == steps - 1:
            logger.info("hidden drafter step %d/%d loss %.4f", step + 1, steps, losses[-1])
    drafter.eval()
    return losses


@torch.no_grad()
def hidden_eval(drafter: HiddenDrafter, target: KimiForCausalLM, windows: torch.Tensor,
                batch_size: int) -> tuple[float, float]:
    """Over ``windows`` ``[n, L + 1]``: the first pass's mean cross-entropy against the target's
    distribution, and the share of positions where its argmax is the target's (what greedy
    speculative decoding accepts of draft 1)."""
    total, agree = 0.0, 0
    for s in range(0, windows.shape[0], batch_size):
        inputs = windows[s:s + batch_size, :-1]
        features, target_logits = target_features(target, drafter.spec.hidden_layers, inputs)
        logits = drafter.logits(drafter_outputs(drafter, inputs, drafter.fuse(features)))
        want = torch.softmax(target_logits.float(), dim=-1)
        total += -(want * F.log_softmax(logits, dim=-1)).sum().item()
        agree += int((logits.argmax(-1) == target_logits.argmax(-1)).sum())
    num_positions = windows.shape[0] * (windows.shape[1] - 1)
    return total / num_positions, agree / num_positions
