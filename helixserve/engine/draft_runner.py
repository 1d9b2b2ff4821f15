"""The ``draft`` method's drafter: a draft model beside the target, on its device and dtype, with
a cache of its own, run before each step's target forward.

**Where it runs.** In a single process beside the target. In a gen world (dp x cp), on the draft's
own mapping, chosen by ``speculative.draft_tensor_parallel_size``:

- ``1`` (the default): on each CP group's leader, the rank that schedules, drafts and verifies for
  its group: the leader holds a full copy of the draft model and its cache on full rows (every
  token of a sequence, not the blocks ``b % cp`` the rank holds of the target's); the other ranks
  hold none of it and run the verify rows the leader sends.
- ``cp``: on every rank of the group in lockstep, its attention heads split over the group
  (:mod:`helixserve.models.heads_tp`: o_proj row-parallel + an all-reduce per mixer, the MLP/MoE
  and the LM head replicated). Before each step's draft forwards the leader sends the group the
  step's :class:`DraftPlan` (full-row tables and draft counts; :meth:`DraftRunner.propose`), and
  the rows of a received prompt (:meth:`DraftRunner.prefill`); each rank runs them and takes its
  own argmax as the next forward's input (every rank gets the same logits from the all-reduce,
  so the same drafts, without a broadcast). The leader's drafts are the ones verified; a rank
  rolls its draft KDA heads back with the rows the leader's rollback message names (the target's
  and the draft's verify records have the same sequences and rows). Each rank holds every
  token's MLA latent row (the latent is head-independent: full-row pages, as the leader alone
  holds them otherwise) and its ``H/cp`` heads' KDA state; the weights of its heads, every
  expert. The cost: an all-reduce per draft layer per draft forward, and a message per step.

**The cache.** The draft model's MLA pages and KDA state slots are its own pools, named by the
target's ids, so the scheduler's one allocation serves both and the draft's is freed with the
target's (a finished, aborted or preempted request): slot ``s`` is the target's slot ``s`` (a
group's slots are alike on every rank); page ``(r, p) -> r * num_blocks + p`` for block ``p`` of
CP rank ``r`` (:func:`~helixserve.kvcache.helix.full_row_table`; in a single process page ``p``
itself). Its pools hold ``cp * num_blocks`` pages and ``num_slots`` slots (of ``H/cp`` KDA heads
under heads TP), and the memory budget counts them on every rank of the group alike, so capacity
stays CP-uniform (:func:`~helixserve.engine.rank_setup.size_cache`). After every step the draft cache holds exactly
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
pre-step states; :func:`~helixserve.engine.draft_rows.combined_record` puts them into one record
shaped as the target's verify record (``n + 1`` rows per speculating sequence), so the target's
``keep`` rows roll the draft's KDA state back with the target's replay (:meth:`ModelRunner.rollback`).
MLA positions of rejected drafts are simply rewritten by the next step. No CUDA graphs (the draft runs eagerly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from helixserve.cache_layout import CacheSpec, ModelCaches, cache_spec_for
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.draft_rows import combined_record, draft_record, draft_row, first_rows
from helixserve.engine.rank_setup import CacheSizes, allocate_rank_caches
from helixserve.engine.runner import ModelRunner, PreparedStep, build_forward_batch
from helixserve.engine.request import Request
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.engine.spec.verify_step import kept_rows
from helixserve.kvcache.manager import CacheHandle
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.kda_spec import KdaRecord
from helixserve.models.helix_load import load_helix_model
from helixserve.models.loading import load_model
from helixserve.parallel import ParallelGroups
from helixserve.planning.drafter import DraftModelError, draft_tp_size

logger = logging.getLogger(__name__)


class DraftPages(Protocol):
    """What the draft reads of the engine's cache manager: a request's full-row block table (in
    the draft's pages) and its handle (its slot)."""

    def full_row_table(self, request_id: str) -> list[int]: ...

    def get(self, request_id: str) -> CacheHandle: ...


def build_draft_runner(speculative: SpeculativeConfig | None, cfg: KimiModelConfig | None, dtype: torch.dtype,
                       layout: CacheSizes, device: torch.device | str, pages: DraftPages | None,
                       cp: int = 1, groups: ParallelGroups | None = None) -> DraftRunner | None:
    """The draft model loaded at the target's dtype and device, its pools at the target's sizes
    (``cp`` times one rank's blocks: full rows of a CP group); ``pages``: the engine's cache
    manager (``None`` on a follower of a heads-TP draft: the leader's plans carry the tables);
    ``groups``: this rank's, for a heads-TP draft (its heads over ``groups.cp``). ``None``
    without a draft config (:func:`~helixserve.planning.drafter.draft_config`)."""
    if speculative is None or cfg is None:
        return None
    assert speculative.draft_model is not None
    if cfg.max_position_embeddings < layout.max_model_len:
        raise DraftModelError(f"speculative.draft_model {speculative.draft_model} has max_position_embeddings "
                              f"{cfg.max_position_embeddings} < the engine's max_model_len {layout.max_model_len}")
    tp = draft_tp_size(speculative)
    if tp not in (1, cp):
        raise DraftModelError(f"speculative.draft_tensor_parallel_size={tp} must be 1 or the world's cp={cp}")
    if tp > 1:
        assert groups is not None, "a heads-TP draft model needs its rank's groups"
        model = load_helix_model(speculative.draft_model, groups.mapping.for_draft_heads_tp(), dtype=dtype,
                                 device=device).bind(groups)
    else:
        model = load_model(speculative.draft_model, dtype=dtype, device=device)
    spec = cache_spec_for(cfg, dtype, layout.tokens_per_block, kda_num_heads=cfg.kda_num_heads // tp)
    logger.info("draft model %s loaded (%s, %s, heads over %d ranks)", speculative.draft_model, dtype, device, tp)
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


@dataclass(slots=True)
class DraftPlan:
    """One step's draft forwards as every rank that runs them runs them: ``steps[j]`` forward
    ``j``'s rows (on the draft's full-row tables), ``reset_slot_ids`` forward 0's fresh slots,
    ``spec`` the step's speculating sequences (indices into its ``seqs``), ``num_drafts`` theirs."""

    steps: list[SchedulerOutput]
    reset_slot_ids: list[int]
    spec: list[int]
    num_drafts: list[int]


DraftWork = DraftPlan | list[ScheduledSeq]  # a step's forwards, or a received prompt's rows


class DraftRunner:
    """Runs the draft model of one engine, or of one rank of a heads-TP draft (see the module
    docstring). ``announce``: set on a heads-TP leader, sends the group each piece of work first."""

    capture_layers = None  # it reads no hidden state of the target
    prompt_cache = None  # its cache of a prompt is rebuilt on the gen side (see the module docstring)

    def __init__(self, model: torch.nn.Module, caches: ModelCaches, device: torch.device | str,
                 pages: DraftPages | None) -> None:
        self.runner = ModelRunner(model, caches, device)
        self.has_kda = bool(caches.kda_state)
        self.pages = pages
        self.announce: Callable[[DraftWork], None] | None = None

    @property
    def is_tensor_parallel(self) -> bool:
        return self.runner.model.mapping.heads_tp

    @property
    def _pages(self) -> DraftPages:
        assert self.pages is not None, "a follower of a heads-TP draft runs the leader's plans only"
        return self.pages

    @torch.inference_mode()
    def run_work(self, work: DraftWork) -> KdaRecord | None:
        """Run one piece of the leader's work (a follower's): a step's plan (its draft KDA record
        returned) or a received prompt's rows."""
        if isinstance(work, DraftPlan):
            return self.run(work)[1]
        self.run_prefill(work)
        return None

    @torch.inference_mode()
    def prefill(self, request: Request, chunk_tokens: int) -> None:
        """Run ``request``'s cached tokens (``num_computed_tokens`` of its prompt and outputs)
        through the draft model into its cache, ``chunk_tokens`` at a time, from a fresh slot: a
        request started on a prompt cache that came from a ctx worker."""
        rows = list(received_prompt_rows(self._pages, request, chunk_tokens))
        if self.announce is not None:
            self.announce(rows)
        self.run_prefill(rows)

    @torch.inference_mode()
    def run_prefill(self, rows: list[ScheduledSeq]) -> None:
        """Run a received prompt's ``rows`` (:meth:`prefill`), each on its own."""
        for seq in rows:
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
        plan = self.plan(out)
        if self.announce is not None:
            self.announce(plan)
        drafts, record = self.run(plan)
        if not plan.spec:
            return None
        host = torch.cat(drafts).tolist()
        at = 0
        for j in range(max(plan.num_drafts)):
            for i, n in zip(plan.spec, plan.num_drafts):
                if n > j:
                    out.seqs[i].token_ids[1 + j] = host[at]
                    at += 1
        return record

    def plan(self, out: SchedulerOutput) -> DraftPlan:
        """``out``'s draft forwards (see the module docstring) on the draft's full-row tables."""
        spec = [i for i, s in enumerate(out.seqs) if s.num_draft_tokens]
        num_drafts = [out.seqs[i].num_draft_tokens for i in spec]
        tables = [self._pages.full_row_table(s.request_id) for s in out.seqs]
        steps = [SchedulerOutput(seqs=[first_rows(s, t) for s, t in zip(out.seqs, tables)])]
        for j in range(1, max(num_drafts, default=0) + 1):
            live = [i for i, n in zip(spec, num_drafts) if n >= j]
            steps.append(SchedulerOutput(seqs=[draft_row(out.seqs[i], j, tables[i]) for i in live]))
        return DraftPlan(steps, list(out.reset_slot_ids), spec, num_drafts)

    @torch.inference_mode()
    def run(self, plan: DraftPlan) -> tuple[list[torch.Tensor], KdaRecord | None]:
        """Run ``plan``'s forwards, each taking the previous one's argmax as its input: the drafts
        (each forward's argmax, on the device) and the draft KDA record of the speculating
        sequences (``None``: none speculates, or the draft model has no KDA)."""
        records: list[KdaRecord] = []
        tokens = self._forward(plan.steps[0], plan.reset_slot_ids, plan.spec, records, None)
        drafts = [tokens] if tokens is not None else []
        for step in plan.steps[1:]:
            tokens = self._forward(step, [], list(range(len(step.seqs))), records, tokens)
            if tokens is not None:
                drafts.append(tokens)
        if not plan.spec or not self.has_kda:
            return drafts, None
        return drafts, combined_record(records, plan.spec, plan.num_drafts)

    def _forward(self, step: SchedulerOutput, reset_slot_ids: list[int], recorded: list[int],
                 records: list[KdaRecord], input_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """One draft forward over ``step``; ``recorded``: its sequences whose KDA inputs are kept
        (a record appended to ``records``). Returns the argmax of its sampled rows (``None``: none)."""
        batch = build_forward_batch(step, self.runner.device)
        if input_tokens is not None:
            batch.input_ids.copy_(input_tokens)
        if self.has_kda and recorded:
            batch.kda_record = draft_record(step, recorded, self.runner.device)
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
