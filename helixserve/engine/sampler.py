"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

A seeded request draws from its own ``torch.Generator`` (seeded once, kept across steps), so the
same seed gives the same tokens whatever else is in the batch. Unseeded requests share one
generator seeded with ``Sampler(seed=...)``: CP ranks that build their samplers with the same seed
and see the same logits and batches sample the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from helixserve.engine.request import SamplingParams


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with tokens outside each row's top-k / top-p nucleus set to -inf.

    ``top_k`` [B] int64 (``V`` = off), ``top_p`` [B] float32 (1 = off). The top-1 token is kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    drop = rank >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[int]:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` float32.
        params: ``B`` sampling params.
        generators: ``B`` generators on ``logits.device`` (``None`` = torch's default RNG).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B = {len(params)}, got {tuple(logits.shape)}")
    logits = logits.float()
    num_rows, vocab = logits.shape
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    tokens = greedy.tolist()
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, device=logits.device)
    sub = [params[i] for i in sampled_rows]
    temperature = torch.tensor([p.temperature for p in sub], device=logits.device)
    top_k = torch.tensor([p.top_k if p.is_top_k_on else vocab for p in sub], device=logits.device)
    top_p = torch.tensor([p.top_p for p in sub], device=logits.device)
    scaled = logits.index_select(0, rows) / temperature.unsqueeze(1)
    if any(p.is_top_k_on or p.top_p < 1 for p in sub):
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    # Gumbel-max via exponential noise: argmax(p / q), q ~ Exp(1). Rows sharing a generator draw
    # together; a seeded request's own generator draws exactly its row, whatever the batch.
    noise = torch.empty_like(probs)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for j, i in enumerate(sampled_rows):
        gen = generators[i] if generators is not None else None
        groups.setdefault(id(gen), (gen, []))[1].append(j)
    for gen, js in groups.values():
        if len(js) == 1:
            noise[js[0]].exponential_(generator=gen)
        else:
            block = torch.empty(len(js), vocab, device=logits.device).exponential_(generator=gen)
            noise[torch.tensor(js, device=logits.device)] = block
    noise.clamp_(min=1e-20)
    choice = (probs / noise).argmax(dim=-1).tolist()
    for j, i in enumerate(sampled_rows):
        tokens[i] = choice[j]
    return tokens


class Sampler:
    """Keeps per-request generators across steps; call ``release`` when a request finishes."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[int]:
        """Tokens for ``logits`` ``[B, V]`` (on ``device``), one per request id."""
        generators = [self._generator(rid, p) for rid, p in zip(request_ids, params, strict=True)]
        return sample(logits, params, generators)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
