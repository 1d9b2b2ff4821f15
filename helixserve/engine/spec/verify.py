"""Verification of draft tokens against the target's logits, in one step (pure torch, any device).

Layout: ``B`` sequences, each with ``n_b <= K`` draft tokens (``K`` the padded width). The target
scored each sequence's last accepted token followed by its drafts, so row ``b`` of
``target_logits`` ``[B, K + 1, V]`` holds, at position ``j``, the target's logits for the token
after draft ``j - 1`` (position 0: after the last accepted token). Positions past ``n_b`` are
padding and never read.

- Greedy rows (``temperature == 0``): drafts are accepted while they equal the target's argmax;
  the next token is the argmax at the first mismatch (the correction) or after the last draft
  (the bonus). The emitted tokens are exactly those of plain greedy decoding.
- Sampled rows: exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023). ``p`` is the
  target's distribution after temperature, top-k and top-p, computed as the sampler does;
  draft ``j`` (drawn from the drafter's ``q_j``) is accepted with probability
  ``min(1, p_j(x) / q_j(x))``; at the first rejection the next token is drawn from
  ``max(p_j - q_j, 0)`` (renormalized), after full acceptance the bonus from ``p_n``. Each
  emitted token is distributed as the target's. A deterministic drafter (n-gram) has a one-hot
  ``q`` (``draft_probs=None``).

Random draws: uniforms for the acceptance tests, then ``V`` exponentials for the next token
(Gumbel-max, as the sampler); a seeded request's own generator draws only its row (its ``n_b``
uniforms, then the exponentials), so its tokens do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve.engine.request import SamplingParams
from helixserve.engine.sampler import mask_top_k_top_p
from helixserve.host_copy import to_device


@dataclass(slots=True)
class VerifyOutput:
    """``token_ids`` ``[B, K + 1]`` int64: row ``b`` emits ``token_ids[b, : num_accepted[b] + 1]``
    (its accepted drafts, then the correction or bonus token), ``-1`` after. ``num_accepted``
    ``[B]`` int64. Both on the logits' device."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``[N, V]`` float32 probabilities of ``logits`` ``[N, V]`` after each row's temperature, top-k
    and top-p, as :func:`helixserve.engine.sampler.sample_on_device` samples them (rows must not be
    greedy)."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [N, V] with N = {len(params)}, got {tuple(logits.shape)}")
    if any(p.is_greedy for p in params):
        raise ValueError("target_probs is for sampled rows; greedy rows have no distribution")
    vocab = logits.shape[1]
    device = logits.device
    temperature = to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device)
    scaled = logits.float() / temperature.unsqueeze(1)
    if any(p.is_top_k_on or p.top_p < 1 for p in params):
        top_k = to_device(torch.tensor([p.top_k if p.is_top_k_on else vocab for p in params]), device)
        top_p = to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32), device)
        scaled = mask_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    B, K = draft_token_ids.shape
    pos = torch.arange(K, device=draft_token_ids.device)
    out = torch.full((B, K + 1), -1, dtype=torch.int64, device=draft_token_ids.device)
    out[:, :K] = torch.where(pos < num_accepted.unsqueeze(1), draft_token_ids, -1)
    return out.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))


def _valid(num_draft_tokens: Sequence[int], K: int, device: torch.device) -> torch.Tensor:
    if any(not 0 <= n <= K for n in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be in [0, {K}] per row, got {list(num_draft_tokens)}")
    counts = to_device(torch.tensor(list(num_draft_tokens), dtype=torch.int64), device)
    return torch.arange(K, device=device) < counts.unsqueeze(1)


def _check_shapes(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_rows: int) -> None:
    if target_logits.dim() != 3 or draft_token_ids.dim() != 2:
        raise ValueError(f"need target_logits [B, K + 1, V] and draft_token_ids [B, K], got "
                         f"{tuple(target_logits.shape)} and {tuple(draft_token_ids.shape)}")
    B, K = draft_token_ids.shape
    if target_logits.shape[:2] != (B, K + 1) or num_rows != B:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not fit draft_token_ids "
                         f"{tuple(draft_token_ids.shape)} and {num_rows} rows")


def greedy_accept(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: Sequence[int]) -> VerifyOutput:
    """Accept drafts while they equal the target's argmax; then the argmax (correction or bonus)."""
    _check_shapes(target_logits, draft_token_ids, len(num_draft_tokens))
    K = draft_token_ids.shape[1]
    argmax = target_logits.argmax(dim=-1)
    match = (draft_token_ids == argmax[:, :K]) & _valid(num_draft_tokens, K, target_logits.device)
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    next_token = argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return VerifyOutput(_assemble(draft_token_ids, num_accepted, next_token), num_accepted)


def _draws(num_draft_tokens: Sequence[int], K: int, vocab: int, device: torch.device,
           generators: Sequence[torch.Generator | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms ``[B, K]`` (1 past each row's drafts) and exponentials ``[B, V]``. A row with a
    generator of its own draws its ``n_b`` uniforms then ``V`` exponentials; rows sharing one
    draw together (``K`` uniforms each, then the exponentials), as the sampler groups them."""
    B = len(num_draft_tokens)
    uniforms = torch.ones(B, K, device=device)
    noise = torch.empty(B, vocab, device=device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for b in range(B):
        gen = generators[b] if generators is not None else None
        groups.setdefault(id(gen), (gen, []))[1].append(b)
    for gen, rows in groups.values():
        if len(rows) == 1:
            b, n = rows[0], num_draft_tokens[rows[0]]
            if n:
                uniforms[b, :n].uniform_(generator=gen)
            noise[b].exponential_(generator=gen)
            continue
        where = to_device(torch.tensor(rows, dtype=torch.int64), device)
        uniforms.index_copy_(0, where, torch.rand(len(rows), K, generator=gen, device=device))
        noise.index_copy_(0, where, torch.empty(len(rows), vocab, device=device).exponential_(generator=gen))
    return uniforms, noise.clamp_(min=1e-20)


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                     params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None = None,
                     draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """Exact rejection sampling for sampled rows (see the module docstring).

    Args:
        draft_probs: ``[B, K, V]`` the drafter's distributions the drafts were drawn from
            (``None``: a deterministic drafter, one-hot ``q``).
    """
    _check_shapes(target_logits, draft_token_ids, len(num_draft_tokens))
    B, K1, V = target_logits.shape
    K, device = K1 - 1, target_logits.device
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V] = {(B, K, V)}, got {tuple(draft_probs.shape)}")
    valid = _valid(num_draft_tokens, K, device)
    p = target_probs(target_logits.reshape(B * K1, V), [q for q in params for _ in range(K1)]).view(B, K1, V)
    uniforms, noise = _draws(num_draft_tokens, K, V, device, generators)
    drafts = draft_token_ids.clamp(min=0).unsqueeze(-1)
    p_draft = p[:, :K].gather(-1, drafts).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.float().gather(-1, drafts).squeeze(-1)
    accepted = (uniforms * q_draft < p_draft) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=device)
    dist = p[rows, num_accepted]
    if K > 0:
        at = num_accepted.clamp(max=K - 1)
        q = (torch.nn.functional.one_hot(draft_token_ids[rows, at].clamp(min=0), V).float() if draft_probs is None
             else draft_probs[rows, at].float())
        residual = (dist - q).clamp(min=0)
        # p == q leaves nothing to correct (such a draft is always accepted, up to rounding): use p
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, dist)
        is_rejected = num_accepted < valid.sum(dim=1)
        dist = torch.where(is_rejected.unsqueeze(1), residual, dist)
    next_token = (dist / noise).argmax(dim=-1)
    return VerifyOutput(_assemble(draft_token_ids, num_accepted, next_token), num_accepted)


def verify_drafts(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                  params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None = None,
                  draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """Greedy rows by :func:`greedy_accept`, sampled rows by :func:`rejection_sample`, in one output."""
    _check_shapes(target_logits, draft_token_ids, len(params))
    out = greedy_accept(target_logits, draft_token_ids, num_draft_tokens)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return out
    rows = to_device(torch.tensor(sampled, dtype=torch.int64), target_logits.device)
    sub = rejection_sample(
        target_logits.index_select(0, rows), draft_token_ids.index_select(0, rows),
        [num_draft_tokens[i] for i in sampled], [params[i] for i in sampled],
        None if generators is None else [generators[i] for i in sampled],
        None if draft_probs is None else draft_probs.index_select(0, rows))
    return VerifyOutput(out.token_ids.index_copy(0, rows, sub.token_ids),
                        out.num_accepted.index_copy(0, rows, sub.num_accepted))
