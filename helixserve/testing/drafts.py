"""Drafts from a known continuation, for tests and benchmarks of speculative decoding: with
random weights a prompt-lookup drafter is never right, so accepted runs and rejections at chosen
positions come from a script of plain decoding's outputs instead. For the ``draft`` method, a
draft checkpoint near its target (:func:`perturbed_checkpoint`) accepts some drafts and rejects
others; a model drafter's own drafts are recorded (and some replaced by a script's) with
:func:`record_drafts`."""

from __future__ import annotations

import shutil
from collections.abc import Collection, Mapping
from typing import Any
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.request import Request, SamplingParams
from helixserve.engine.spec.drafting import NgramDrafter

Script = Mapping[tuple[int, ...], list[int]]  # prompt -> plain decoding's outputs
Proposals = dict[tuple[tuple[int, ...], int], list[int]]  # (prompt, context_len) -> the drafter's drafts


class ScriptedDrafter(NgramDrafter):
    """Drafts plain decoding's next outputs of the request's prompt (``outputs``), with the draft
    positions of ``wrong`` (one set for every prompt, or per prompt) replaced by a token the
    target does not pick (``t + 1`` mod ``vocab_size``); the real caps and step budget apply."""

    def __init__(self, num_draft_tokens: int, outputs: Script,
                 wrong: Collection[int] | Mapping[tuple[int, ...], Collection[int]] = frozenset(),
                 vocab_size: int = 512) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_draft_tokens=num_draft_tokens), max_model_len=10**6)
        self.outputs, self.wrong, self.vocab_size = outputs, wrong, vocab_size

    def propose(self, request: Request, budget: int) -> list[int]:
        n = min(self.cap(request), budget)
        prompt, done = tuple(request.prompt_token_ids), len(request.output_token_ids)
        drafts = self.outputs[prompt][done: done + n]
        wrong = self.wrong.get(prompt, ()) if isinstance(self.wrong, Mapping) else self.wrong
        return [(t + 1) % self.vocab_size if j in wrong else t for j, t in enumerate(drafts)]


def perturbed_checkpoint(src: str | Path, dst: str | Path, scale: float, seed: int = 0) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose floating-point weights are multiplied by
    ``1 + scale * N(0, 1)`` (seeded): a draft model that mostly agrees with its target, so that
    verify steps accept runs of every length and reject at every position."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(seed)
    for path in sorted(dst.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (t.float() * (1 + scale * noise)).to(t.dtype)
        save_file(tensors, path)
    return dst


def run_mixed(engine: Any, first: tuple[str, list[int], SamplingParams],
              others: list[tuple[str, list[int], SamplingParams]]) -> tuple[list[Request], bool]:
    """Start ``first`` (two steps: its prompt and a decode), then add ``others`` and step the
    engine (an :class:`~helixserve.engine.core.EngineCore`) to the end. Returns the requests and
    whether a step verified drafts while prompt tokens were still to run (a mixed step, under a
    small token budget)."""
    requests = [engine.add_request(*first)]
    engine.step()
    engine.step()
    requests += [engine.add_request(*other) for other in others]
    mixed = False
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        waiting_before = sched.num_waiting + sum(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        before = engine.spec_stats.num_drafts
        engine.step()
        mixed |= waiting_before > 0 and engine.spec_stats.num_drafts > before
    return requests, mixed


def record_drafts(engine: Any, script: Script | None = None) -> Proposals:
    """Test-only injector on an :class:`~helixserve.engine.core.EngineCore`'s model drafter: the
    drafter runs as it does (its forwards write its cache) and each speculating sequence's drafts
    are recorded in the returned dict (filled as the engine steps), by prompt and context length;
    then the drafts of the prompts in ``script`` are replaced by plain decoding's next outputs, so
    verify steps accept whole runs."""
    runner, script = engine.draft_runner, script or {}
    propose = runner.propose
    proposals: Proposals = {}

    def recorded(out: Any) -> Any:
        record = propose(out)
        for s in out.seqs:
            if s.num_draft_tokens:
                request = engine.scheduler.get_request(s.request_id)
                prompt, done = tuple(request.prompt_token_ids), len(request.output_token_ids)
                proposals[(prompt, s.context_len)] = list(s.token_ids[1:])
                if prompt in script:
                    s.token_ids[1:] = script[prompt][done: done + s.num_draft_tokens]
        return record
    runner.propose = recorded
    return proposals
