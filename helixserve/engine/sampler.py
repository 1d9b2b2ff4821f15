"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

A seeded request draws from its own ``torch.Generator`` (seeded once, kept across steps), so the
same seed gives the same tokens whatever else is in the batch. Unseeded requests share one
generator seeded with ``Sampler(seed=...)``: CP ranks that build their samplers with the same seed
and see the same logits and batches sample the same tokens.

A ``top_k`` above the vocabulary keeps every token (it is clamped to the vocabulary size, which
masks nothing). :meth:`Sampler.check` tries each request's part of a step (its values, its
generator) before the step runs, so that a request whose part cannot be built is failed alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from helixserve.engine.request import SamplingParams
from helixserve.host_copy import to_device


def _check_row(p: SamplingParams) -> None:
    """``ValueError`` naming a sampled row's value that its int64 / float32 rows cannot hold
    (``top_k`` is clamped to the vocabulary, so only its type and lower end matter)."""
    if type(p.top_k) is not int or p.top_k < -(2**63):
        raise ValueError(f"top_k {p.top_k!r} does not fit an int64 row")
    for name, value in (("temperature", p.temperature), ("top_p", p.top_p)):
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{name} {value!r} is not a finite number")


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """One token per row as int64 ``[B]`` on ``logits.device``, with every kernel enqueued and no
    host sync (the per-row sampling parameters go over in one pinned copy).

    Args:
        logits: ``[B, V]``.
        params: ``B`` sampling params.
        generators: ``B`` generators on ``logits.device`` (``None`` = torch's default RNG).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B = {len(params)}, got {tuple(logits.shape)}")
    logits = logits.float()
    vocab = logits.shape[1]
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled_rows:
        return tokens
    device = logits.device
    sub = [params[i] for i in sampled_rows]
    host = torch.tensor(
        [sampled_rows, [min(p.top_k, vocab) if p.is_top_k_on else vocab for p in sub]], dtype=torch.int64,
        pin_memory=logits.is_cuda,
    )
    host_f = torch.tensor([[p.temperature for p in sub], [p.top_p for p in sub]], pin_memory=logits.is_cuda)
    ints, floats = host.to(device, non_blocking=True), host_f.to(device, non_blocking=True)
    rows, top_k = ints[0], ints[1]
    temperature, top_p = floats[0], floats[1]
    scaled = logits.index_select(0, rows) / temperature.unsqueeze(1)
    if any(p.is_top_k_on and p.top_k < vocab or p.top_p < 1 for p in sub):
        scaled = mask_top_k_top_p(scaled, top_k, top_p)
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
            block = torch.empty(len(js), vocab, device=device).exponential_(generator=gen)
            where = to_device(torch.tensor(js), device)
            noise.index_copy_(0, where, block)
    noise.clamp_(min=1e-20)
    choice = (probs / noise).argmax(dim=-1)
    return tokens.index_copy(0, rows, choice)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[int]:
    """Sample one token per row (see :func:`sample_on_device`); one host sync."""
    return sample_on_device(logits, params, generators).tolist()


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
        return self.launch(logits, request_ids, params).tolist()

    def launch(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        """The tokens as a device tensor, every kernel enqueued, no host sync yet."""
        generators = [None if p.is_greedy else self.generator(rid, p)
                      for rid, p in zip(request_ids, params, strict=True)]
        return sample_on_device(logits, params, generators)

    def check(self, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> dict[str, str]:
        """Why each request whose sampling cannot be set up fails (request id -> reason; empty:
        none): its values must pack into the step's int64 / float32 rows and its seed must seed
        a generator (created here, kept for the step). Nothing is drawn."""
        failures: dict[str, str] = {}
        for rid, p in zip(request_ids, params, strict=True):
            if p.is_greedy:
                continue
            try:
                _check_row(p)
            except Exception as exc:  # noqa: BLE001 - reported as this request's failure
                failures[rid] = f"{type(exc).__name__}: {exc}"
                continue
            try:
                self.generator(rid, p)
            except Exception as exc:  # noqa: BLE001
                failures[rid] = f"seed {p.seed!r} does not seed a generator: {type(exc).__name__}: {exc}"
        return failures

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The generator a sampled request draws from (its own when seeded, kept until released)."""
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
