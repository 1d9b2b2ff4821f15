"""The ``draft`` method's drafter: a draft model beside the target, on its device and dtype, with
a cache of its own, run before each step's target forward.

**Where it runs.** In a single process beside the target; in a gen world (dp x cp) on each CP
group's leader, the rank that schedules, drafts and verifies for its group: the leader holds a
full copy of the draft model and its cache on full rows (every token of a sequence, not the
blocks ``b % cp`` the rank holds of the target's). A draft model is small (its weights and KV fit
one rank), so the other ranks hold none of it; they run the verify rows the leader sends. (Heads
TP over the CP group would spread the draft's KV and weights too, at a collective per draft
layer per draft token.)

**The cache.** The draft model's MLA pages and KDA state slots are its own pools, named by the
target's ids, so the scheduler's one allocation serves both and the draft's is freed with the
target's (a finished, aborted or preempted request): slot ``s`` is the target's slot ``s`` (a
group's slots are alike on every rank); page ``(r, p) -> r * num_blocks + p`` for block ``p`` of
CP rank ``r`` (:func:`~helixserve.kvcache.helix.full_row_table`; in a single process page ``p``
itself). Its pools hold ``cp * num_blocks`` pages and ``num_slots`` slots, and the memory budget
counts them on every rank of the group alike, so capacity stays CP-uniform
(:func:`~helixserve.engine.rank_setup.size_cache`). After every step the draft cache holds exactly
the tokens the target's does. A prompt whose cache came from a ctx worker is run through the
draft model when its request starts decoding (:meth:`DraftRunner.prefill`): the draft's prompt
cache is rebuilt on the gen side, not transferred.

**A step** (:meth:`DraftRunner.propose`), for a scheduled step of ``K`` = the most drafts of one
sequence:

0. the step's every sequence as the target runs it (prompt chunks, decodes), except that a
   speculating sequence runs its last sampled token only; its row's argmax is draft 1;
1. .. ``K``. forward ``j`` runs, for every speculating sequence with ``n >= j`` drafts, draft
   ``j`` at position ``context_len + j`` (one row each, input the previous forward's argmax on
   the device); a sequence with ``n > j`` gets draft ``j + 1`` from it. Forward ``K`` runs the
   last drafts without the LM head, so that the draft cache holds all ``n + 1`` rows the target
   verifies, as the target's does.

Drafts are the draft model's argmax (a deterministic drafter: the verifier's rejection sampling
treats them as one-hot proposals, exact at any temperature). Each forward's KDA layers keep, as a
verify step's do (:mod:`helixserve.models.kda_spec`), the speculating rows' projected inputs and
pre-step states; :func:`combined_record` puts them into one record shaped as the target's verify
record (``n + 1`` rows per speculating sequence), so the target's ``keep`` rows roll the draft's
KDA state back with the target's replay (:meth:`ModelRunner.rollback`). MLA positions of rejected
drafts are simply rewritten by the next step. No CUDA graphs (the draft runs eagerly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from helixserve.cache_layout import CacheSpec, ModelCaches, cache_spec_for
from helixserve.config import CacheConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.rank_setup import CacheSizes, allocate_rank_caches
from helixserve.engine.runner import ModelRunner, PreparedStep, build_forward_batch
from helixserve.engine.request import Request
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.engine.spec.verify_step import kept_rows
from helixserve.host_copy import to_device
from helixserve.kvcache.manager import CacheHandle
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.hidden_drafter import is_hidden_drafter
from helixserve.models.kda_spec import KdaRecord, KdaSaved
from helixserve.models.loading import load_model

logger = logging.getLogger(__name__)


class DraftPages(Protocol):
    """What the draft reads of the engine's cache manager: a request's full-row block table (in
    the draft's pages) and its handle (its slot)."""

    def full_row_table(self, request_id: str) -> list[int]: ...

    def get(self, request_id: str) -> CacheHandle: ...


class DraftModelError(ValueError):
    """A draft model that cannot serve beside its target."""


class DraftVocabMismatchError(DraftModelError):
    """The draft checkpoint's vocabulary is not the target's (both sizes named)."""

    def __init__(self, draft_model: Path, draft_vocab: int, target_vocab: int) -> None:
        super().__init__(f"speculative.draft_model {draft_model} has vocab_size {draft_vocab}, the target model "
                         f"has vocab_size {target_vocab}: a draft model must share the target's vocabulary")
        self.draft_vocab, self.target_vocab = draft_vocab, target_vocab


def draft_config(speculative: SpeculativeConfig | None, target: KimiModelConfig,
                 cache: CacheConfig) -> KimiModelConfig | None:
    """The draft checkpoint's config (``None``: no ``draft`` method), checked against the target's
    and the engine's before any weight is read (:class:`DraftModelError`)."""
    if speculative is None or speculative.method != "draft":
        return None
    path = speculative.draft_model
    assert path is not None  # SpeculativeConfig requires it for method draft
    if cache.prefix_caching:
        raise DraftModelError("speculative.method 'draft' does not run with cache.prefix_caching: the draft "
                              "model keeps no KDA state checkpoints of cached prefixes")
    if is_hidden_drafter(path):
        raise DraftModelError(f"speculative.draft_model {path} is a hidden-state drafter: use method 'hidden'")
    cfg = KimiModelConfig.from_pretrained(path)
    if cfg.vocab_size != target.vocab_size:
        raise DraftVocabMismatchError(path, cfg.vocab_size, target.vocab_size)
    for kind, draft_layers, target_layers in (("MLA", cfg.mla_layer_ids, target.mla_layer_ids),
                                              ("KDA", cfg.kda_layer_ids, target.kda_layer_ids)):
        if draft_layers and not target_layers:
            raise DraftModelError(f"speculative.draft_model {path} has {kind} layers and the target none: its "
                                  f"cache would have no {kind} pages or slots to share")
    return cfg


def build_draft_runner(speculative: SpeculativeConfig | None, cfg: KimiModelConfig | None, dtype: torch.dtype,
                       layout: CacheSizes, device: torch.device | str, pages: DraftPages,
                       cp: int = 1) -> DraftRunner | None:
    """The draft model loaded at the target's dtype and device, its pools at the target's sizes
    (``cp`` times one rank's blocks: full rows of a CP group); ``pages``: the engine's cache
    manager. ``None`` without a draft config (:func:`draft_config`)."""
    if speculative is None or cfg is None:
        return None
    assert speculative.draft_model is not None
    if cfg.max_position_embeddings < layout.max_model_len:
        raise DraftModelError(f"speculative.draft_model {speculative.draft_model} has max_position_embeddings "
                              f"{cfg.max_position_embeddings} < the engine's max_model_len {layout.max_model_len}")
    model = load_model(speculative.draft_model, dtype=dtype, device=device)
    spec = cache_spec_for(cfg, dtype, layout.tokens_per_block, kda_num_heads=cfg.kda_num_heads)
    logger.info("draft model %s loaded (%s, %s)", speculative.draft_model, dtype, device)
    return DraftRunner(model, full_row_caches(spec, layout, cp, device), device, pages)


def full_row_caches(spec: CacheSpec, layout: CacheSizes, cp: int, device: torch.device | str) -> ModelCaches:
    """A drafter's pools of cache ``spec``: ``cp`` times one rank's blocks (a CP group's full rows)."""
    return allocate_rank_caches(spec, replace(layout, num_blocks=layout.num_blocks * cp), device)


def received_prompt_rows(pages: DraftPages, request: Request, chunk_tokens: int) -> Iterator[ScheduledSeq]:
    """``request``'s cached tokens (``num_computed_tokens`` of its prompt and outputs) as prefill rows
    of ``chunk_tokens`` on its full-row table: what a drafter writes for a request started on a
    prompt cache that came from a ctx worker."""
    rid = request.request_id
    table, slot = pages.full_row_table(rid), pages.get(rid).slot
    token_ids = (request.prompt_token_ids + request.output_token_ids)[:request.num_computed_tokens]
    for start in range(0, len(token_ids), chunk_tokens):
        yield ScheduledSeq(rid, token_ids[start:start + chunk_tokens], start, table, slot, is_prefill=True,
                           sample=False)


class DraftRunner:
    """Runs the draft model of one engine (see the module docstring)."""

    capture_layers = None  # it reads no hidden state of the target
    prompt_cache = None  # its cache of a prompt is rebuilt on the gen side (see the module docstring)

    def __init__(self, model: torch.nn.Module, caches: ModelCaches, device: torch.device | str,
                 pages: DraftPages) -> None:
        self.runner = ModelRunner(model, caches, device)
        self.has_kda = bool(caches.kda_state)
        self.pages = pages

    @torch.inference_mode()
    def prefill(self, request: Request, chunk_tokens: int) -> None:
        """Run ``request``'s cached tokens (``num_computed_tokens`` of its prompt and outputs)
        through the draft model into its cache, ``chunk_tokens`` at a time, from a fresh slot: a
        request started on a prompt cache that came from a ctx worker."""
        for seq in received_prompt_rows(self.pages, request, chunk_tokens):
            fresh = [seq.slot] if seq.context_len == 0 and seq.slot is not None else []
            self.runner.run(PreparedStep(build_forward_batch(SchedulerOutput(seqs=[seq]), self.runner.device),
                                         fresh, None))

    @property
    def caches(self) -> ModelCaches:
        return self.runner.caches

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> KdaRecord | None:
        """Run the draft model over ``out`` (see the module docstring) and write each speculating
        sequence's drafts into its ``token_ids[1:]``. Returns the draft KDA record of the
        speculating sequences (``None``: none speculates, or the draft model has no KDA)."""
        spec = [i for i, s in enumerate(out.seqs) if s.num_draft_tokens]
        num_drafts = [out.seqs[i].num_draft_tokens for i in spec]
        tables = [self.pages.full_row_table(s.request_id) for s in out.seqs]
        first = SchedulerOutput(seqs=[_first_rows(s, t) for s, t in zip(out.seqs, tables)])
        records: list[KdaRecord] = []
        tokens = self._forward(first, out.reset_slot_ids, spec, records, None)
        drafts = [tokens] if tokens is not None else []
        for j in range(1, max(num_drafts, default=0) + 1):
            live = [i for i, n in zip(spec, num_drafts) if n >= j]
            step = SchedulerOutput(seqs=[_draft_row(out.seqs[i], j, tables[i]) for i in live])
            tokens = self._forward(step, [], list(range(len(live))), records, tokens)
            if tokens is not None:
                drafts.append(tokens)
        if not spec:
            return None
        host = torch.cat(drafts).tolist()
        at = 0
        for j in range(max(num_drafts)):
            for i, n in zip(spec, num_drafts):
                if n > j:
                    out.seqs[i].token_ids[1 + j] = host[at]
                    at += 1
        return combined_record(records, spec, num_drafts, out) if self.has_kda else None

    def _forward(self, step: SchedulerOutput, reset_slot_ids: list[int], recorded: list[int],
                 records: list[KdaRecord], input_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """One draft forward over ``step``; ``recorded``: its sequences whose KDA inputs are kept
        (a record appended to ``records``). Returns the argmax of its sampled rows (``None``: none)."""
        batch = build_forward_batch(step, self.runner.device)
        if input_tokens is not None:
            batch.input_ids.copy_(input_tokens)
        if self.has_kda and recorded:
            batch.kda_record = _record(step, recorded, self.runner.device)
            if batch.kda_record.steps is not None:
                batch.is_decode = False  # the row-by-row path keeps the inputs; the decode path does not
            records.append(batch.kda_record)
        logits = self.runner.run(PreparedStep(batch, reset_slot_ids, None))
        return logits.argmax(dim=-1) if logits.shape[0] else None

    def rollback(self, out: SchedulerOutput, record: KdaRecord, get_request: Callable[[str], Request | None]) -> None:
        """After ``update_from_output`` of ``out``: roll the draft's KDA state back to the rows
        the target kept (:func:`~helixserve.engine.spec.verify_step.kept_rows`)."""
        self.runner.rollback(record, kept_rows(out, record, get_request))

    def record(self, out: SchedulerOutput, batch: ForwardBatch) -> None:
        """Nothing to keep of the target's forward (the draft model reads tokens only)."""

    def hold(self, request_ids: list[str]) -> None:
        """Nothing to complete: after a prefill the draft's cache holds the prompt."""

    def forget(self, request_ids: list[str]) -> None:
        """Nothing kept per request outside the cache."""


def _first_rows(seq: ScheduledSeq, table: list[int]) -> ScheduledSeq:
    """``seq`` as forward 0 runs it (on the draft's block ``table``): a speculating sequence's
    last sampled token only, sampled; anything else as scheduled, unsampled."""
    if not seq.num_draft_tokens:
        return ScheduledSeq(seq.request_id, seq.token_ids, seq.context_len, table, seq.slot,
                            seq.is_prefill, sample=False)
    return ScheduledSeq(seq.request_id, seq.token_ids[:1], seq.context_len, table, seq.slot,
                        is_prefill=False, sample=True)


def _draft_row(seq: ScheduledSeq, j: int, table: list[int]) -> ScheduledSeq:
    """Forward ``j``'s row of a speculating sequence: draft ``j`` (its token comes from the
    previous forward), sampled while drafts are left to draw."""
    return ScheduledSeq(seq.request_id, [0], seq.context_len + j, table, seq.slot, is_prefill=False,
                        sample=seq.num_draft_tokens > j)


def _record(step: SchedulerOutput, recorded: list[int], device: torch.device) -> KdaRecord:
    """A KDA record of one row (each sequence's last) of the sequences ``recorded``; row by row
    when every sequence of ``step`` is one row after a cached context."""
    ends, end = [], 0
    for s in step.seqs:
        end += s.num_tokens
        ends.append(end - 1)
    as_tensor = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), device)  # noqa: E731
    slots = [step.seqs[i].slot for i in recorded]
    record = KdaRecord(as_tensor(recorded), as_tensor([ends[i] for i in recorded]), list(range(len(recorded))),
                       [1] * len(recorded), as_tensor(slots), list(recorded))
    if all(s.num_tokens == 1 and s.context_len > 0 for s in step.seqs):
        record.steps = [(as_tensor(list(range(len(step.seqs)))), as_tensor([s.slot for s in step.seqs]))]
    return record


def combined_record(records: list[KdaRecord], spec: list[int], num_drafts: list[int],
                    out: SchedulerOutput) -> KdaRecord:
    """The draft forwards' records as one verify record: speculating sequence ``p``'s rows
    ``0 .. n_p`` (forward ``j``'s row for ``j``), sequence after sequence; the pre-step states
    are forward 0's."""
    order: list[int] = []
    offsets = [0]
    for j in range(len(records)):
        offsets.append(offsets[-1] + sum(n >= j for n in num_drafts))
    for p, n in enumerate(num_drafts):
        order += [offsets[j] + sum(m >= j for m in num_drafts[:p]) for j in range(n + 1)]
    device = records[0].slots.device
    index = to_device(torch.tensor(order, dtype=torch.int64), device)
    starts = [0]
    for n in num_drafts[:-1]:
        starts.append(starts[-1] + n + 1)
    combined = KdaRecord(to_device(torch.tensor(spec, dtype=torch.int64), device), index, starts,
                         [n + 1 for n in num_drafts], records[0].slots, list(spec))
    for layer, first in records[0].layers.items():
        parts = [r.layers[layer] for r in records]
        combined.layers[layer] = KdaSaved(
            *(torch.cat([getattr(s, name) for s in parts]).index_select(0, index) for name in ("qkv", "g", "beta")),
            first.conv_state, first.kda_state)
    return combined
