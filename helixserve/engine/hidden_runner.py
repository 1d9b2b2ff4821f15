"""The ``hidden`` method's drafter: a hidden-state drafter (EAGLE-3 class,
:mod:`helixserve.models.hidden_drafter`) beside the target, on its device and dtype, fed the
target's layer outputs, run before each step's target forward.

**Where it runs.** In a single process beside the target; in a gen world (dp x cp), as the
``draft`` method's draft model does (:mod:`.draft_runner`), chosen by
``speculative.draft_tensor_parallel_size``: ``1``, on each CP group's leader, the rank that
schedules, drafts and verifies for its group (the leader holds the drafter and its cache on full
rows; the other ranks hold none of it); ``cp``, on every rank of the group in lockstep, its MLA
heads split over the group (:mod:`helixserve.models.hidden_drafter`). Then the leader sends the
group each call that runs drafter forwards or moves its per-request state (a step, a received
prompt, held prefills: :mod:`.hidden_work`) before running it itself; every rank keeps its own
copy of each sequence's target rows (:meth:`HiddenDraftRunner.record` after each target forward:
the captured hidden states are the same on every rank), holds the drafter's full-row pages, a
feature row per slot and its heads' weights, and computes the same drafts (the all-reduced
outputs and the replicated LM head), so nothing is broadcast per step but the step's sequences.
The requests the leader forgot go to the group with its next step.

**What it reads.** Every target forward keeps the outputs of the drafter's ``hidden_layers`` for
every row (``batch.hidden_capture``, no second forward); :meth:`HiddenDraftRunner.record` keeps
each scheduled sequence's rows (their tokens and features) until the sequence's next step. Row
``i`` of the drafter reads token ``x_i`` and the target's features at ``i - 1``. In a world every
rank of a CP group keeps the same layers and the forward all-gathers the token-sliced ones over
the group (:mod:`helixserve.models.hidden_capture`), so the leader holds the group's every row.

**The cache.** The drafter's MLA pages are its own pool named by the target's page ids (as the
``draft`` method's): one allocation serves both, the drafter's pages are freed with the target's,
and the memory budget counts both (:func:`~helixserve.engine.rank_setup.size_cache`). In a world
its pool holds ``cp * num_blocks`` pages, page ``r * num_blocks + p`` for block ``p`` of CP rank
``r`` (the group's full-row table, :meth:`~helixserve.kvcache.group_cache.GroupCacheManager.full_row_table`).
It has no KDA state, so nothing rolls back.

**A prompt cache from a ctx worker** (disaggregated serving): the target's hidden states of the
prompt are on the ctx worker. A ctx engine with this drafter runs it over the prompt as any engine
does (each prefill chunk's catch-up); when the prefill finishes with its cache held,
:meth:`HiddenDraftRunner.hold` writes the rows the first decoded step would catch up (all but that
position) and keeps the target's features of the last prompt position at the request's slot
(``prompt_cache.features``). The transceiver sends both, the drafter's pages and that row
(``prompt_cache``, :class:`~helixserve.cache_layout.DraftCaches`), to the gen CP group's leader,
whose receiver marks the request (``prompt_cache.received``); :meth:`HiddenDraftRunner.prefill`
then only sets the request's catch-up to start at the first decoded position with that row (under
heads TP after broadcasting the request's drafter pages and that row to the group,
:func:`~.hidden_work.share_prompt_cache`): the leader drafts exactly as an aggregated engine would. A request whose ctx sent no drafter cache
(another drafter or none there, or a shard copied out of the ctx's pools) gets the drafter's cache
of the prompt written from the prompt tokens with zero features (the drafter's own forward over
the prompt, no target forward); the drafter reads the target's features from the first decoded
position on. Drafts are verified by the target either way, so the output is exact; without the
ctx's cache the drafts and acceptance may differ from an aggregated run's.

**A step** (:meth:`HiddenDraftRunner.propose`), for a scheduled sequence at context ``c`` whose
drafter cache holds positions ``< d``:

0. catch-up: rows ``d .. c`` (tokens known: the accepted ones and ``x_c``; features from the
   target's previous forward of the sequence: its accepted rows, a prompt chunk's rows), one
   forward for every scheduled sequence; a speculating sequence's row ``c`` gives draft 1. So the
   drafter's cache of accepted positions is written from the target's features a step late (the
   EAGLE way), and its rows of drafts (written from its own outputs) are rewritten then.
1. .. ``K - 1``. forward ``j`` runs draft ``j`` at position ``c + j`` for every speculating
   sequence with more than ``j`` drafts, reading the drafter's own output of the row before in
   place of the target's features; its argmax is draft ``j + 1``.

Drafts are argmax (one-hot proposals: the verifier's rejection sampling is exact at any
temperature). Rows the target's page table already covers are the only ones written (``c + j <
c + n``). Target decode steps run eagerly (no CUDA graphs: every step's hidden states are read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from helixserve.cache_layout import DraftCaches, ModelCaches, cache_spec_for
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.draft_runner import DraftPages, full_row_caches, received_prompt_rows
from helixserve.engine.hidden_work import HiddenHold, HiddenPrompt, HiddenStep, HiddenWork, share_prompt_cache
from helixserve.engine.rank_setup import CacheSizes
from helixserve.engine.request import Request
from helixserve.engine.runner import build_forward_batch
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.hidden_drafter import HiddenDrafter, load_hidden_drafter
from helixserve.models.hidden_drafter_config import HiddenDrafterError
from helixserve.models.kda_spec import KdaRecord
from helixserve.parallel import ParallelGroups
from helixserve.planning.drafter import draft_tp_size

logger = logging.getLogger(__name__)


def build_hidden_runner(speculative: SpeculativeConfig, cfg: KimiModelConfig, dtype: torch.dtype,
                        layout: CacheSizes, device: torch.device | str, pages: DraftPages | None,
                        cp: int = 1, groups: ParallelGroups | None = None) -> HiddenDraftRunner:
    """The drafter loaded at the target's dtype and device, its MLA pool at ``cp`` times one rank's
    block count (full rows of a CP group); ``pages``: the engine's cache manager (``None`` on a
    follower of a heads-TP drafter: the leader's work carries the tables); ``groups``: this
    rank's, for a heads-TP drafter (its heads over ``groups.cp``)."""
    assert speculative.draft_model is not None
    if cfg.max_position_embeddings < layout.max_model_len:
        raise HiddenDrafterError(f"speculative.draft_model {speculative.draft_model} has max_position_embeddings "
                                 f"{cfg.max_position_embeddings} < the engine's max_model_len {layout.max_model_len}")
    tp = draft_tp_size(speculative)
    if tp not in (1, cp):
        raise HiddenDrafterError(f"speculative.draft_tensor_parallel_size={tp} must be 1 or the world's cp={cp}")
    if tp > 1:
        assert groups is not None, "a heads-TP hidden drafter needs its rank's groups"
        model = load_hidden_drafter(speculative.draft_model, dtype, device,
                                    groups.mapping.for_draft_heads_tp()).bind(groups)
    else:
        model = load_hidden_drafter(speculative.draft_model, dtype=dtype, device=device)
    spec = cache_spec_for(cfg, dtype, layout.tokens_per_block, kda_num_heads=cfg.kda_num_heads)
    logger.info("hidden drafter %s loaded (%s, %s, heads over %d ranks), reading target layers %s",
                speculative.draft_model, dtype, device, tp, list(model.spec.hidden_layers))
    features = torch.zeros(layout.num_slots + 1, model.spec.feature_size, dtype=dtype, device=device)  # (a spare slot)
    return HiddenDraftRunner(model, full_row_caches(spec, layout, cp, device), device, pages, features,
                             groups if tp > 1 else None)


@dataclass(slots=True)
class _SeqState:
    """One sequence's drafter state: its cache holds positions ``< synced``; ``tokens`` and
    ``features`` are the target's rows of its last step, from position ``start``."""

    synced: int = 0
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    features: torch.Tensor | None = None


class HiddenDraftRunner:
    """Runs the hidden drafter of one engine, or of one rank of a heads-TP drafter (see the module
    docstring). ``slot_features``: the feature row of a prompt's last position per slot (a prompt
    cache's). ``announce``: set on a heads-TP leader, sends the group each piece of work first
    (:mod:`.hidden_work`); ``groups``: a heads-TP rank's."""

    def __init__(self, model: HiddenDrafter, caches: ModelCaches, device: torch.device | str,
                 pages: DraftPages | None, slot_features: torch.Tensor, groups: ParallelGroups | None = None) -> None:
        self.model, self.caches, self.device, self.pages = model, caches, torch.device(device), pages
        self.capture_layers: tuple[int, ...] | None = model.spec.hidden_layers
        self._num_features = model.spec.feature_size
        self._seqs: dict[str, _SeqState] = {}
        self.slot_features, self.groups = slot_features, groups
        # what travels with a request (see the module docstring): the leader's (its receiver's)
        self.prompt_cache = (DraftCaches(caches.mla_kv, slot_features, pages.full_row_table) if pages is not None
                             else None)
        self.announce: Callable[[HiddenWork], None] | None = None
        self._forgotten: list[str] = []  # a heads-TP leader's, sent with its next step

    @property
    def num_features(self) -> int:
        """Target features a drafter row reads (its hidden layers' outputs side by side)."""
        return self._num_features

    @property
    def is_tensor_parallel(self) -> bool:
        return self.model.mapping.heads_tp

    @property
    def _pages(self) -> DraftPages:
        assert self.pages is not None, "a follower of a heads-TP drafter runs the leader's work only"
        return self.pages

    def _run_announced(self, work: HiddenWork) -> list[torch.Tensor]:
        if self.announce is not None:
            self.announce(work)
        return self._run(work)

    @torch.inference_mode()
    def run_work(self, work: HiddenWork) -> None:
        """Run one piece of the leader's work (a follower's, :mod:`.hidden_work`). No KDA record: ``None``."""
        self._run(work)

    def _run(self, work: HiddenWork) -> list[torch.Tensor]:
        """``work``'s forwards; a step's drafts (each draft forward's argmax, on the device)."""
        if isinstance(work, HiddenStep):
            return self._step(work)
        if isinstance(work, HiddenPrompt):
            self._prompt(work)
        else:
            self._hold(work)
        return []

    @torch.inference_mode()
    def prefill(self, request: Request, chunk_tokens: int) -> None:
        """A request started on a prompt cache from a ctx worker (module docstring): when the
        drafter's cache of the prompt came with it (``prompt_cache.received``), its next catch-up
        is the first decoded position, reading the target's features of the last prompt position
        that came along. Else write the drafter's cache of its cached tokens
        (``num_computed_tokens`` of its prompt and outputs), ``chunk_tokens`` at a time, with zero
        features; its next catch-up starts at the first position the gen computes."""
        rid, n = request.request_id, request.num_computed_tokens
        received = self.prompt_cache is not None and rid in self.prompt_cache.received
        if received:
            assert self.prompt_cache is not None
            self.prompt_cache.received.discard(rid)
        slot = self._pages.get(rid).slot
        assert slot is not None or not received  # the receiver takes the drafter's cache only with a slot
        rows = [] if received else list(received_prompt_rows(self._pages, request, chunk_tokens))
        table = self._pages.full_row_table(rid) if received else []
        tokens = request.prompt_token_ids + request.output_token_ids
        self._run_announced(HiddenPrompt(rid, n, tokens[n - 1], slot, table, received, rows))

    def _prompt(self, work: HiddenPrompt) -> None:
        rid, n = work.request_id, work.num_tokens
        if work.received:
            assert work.slot is not None
            if self.groups is not None:  # the leader's received cache, onto every rank of the group
                share_prompt_cache(self.groups, self.caches, self.slot_features, work.block_table, work.slot)
            self._seqs[rid] = _SeqState(synced=n, start=n - 1, tokens=[work.last_token],
                                        features=self.slot_features[work.slot: work.slot + 1].clone())
            return
        for seq in work.rows:
            fused = self.model.fuse(torch.zeros(len(seq.token_ids), self._num_features, dtype=self.model.dtype,
                                                device=self.device))
            self._forward([seq], fused, None)
        self._seqs[rid] = _SeqState(synced=n, start=n)

    @torch.inference_mode()
    def hold(self, request_ids: list[str]) -> None:
        """Requests whose cache is held for a gen worker (a ctx worker's finished prefills): write
        the drafter's cache of their prompt rows not written yet (the catch-up an aggregated engine
        runs at the first decoded position, less that position) and keep the target's features of
        the last prompt position at the request's slot (``prompt_cache.features``): both travel
        with the request (module docstring)."""
        if self.prompt_cache is None or not request_ids:
            return
        requests = [(rid, self._pages.full_row_table(rid), self._pages.get(rid).slot) for rid in request_ids
                    if rid in self._seqs]
        if requests:
            self._run_announced(HiddenHold(requests))

    def _hold(self, work: HiddenHold) -> None:
        rows, features, is_written = [], [], False
        for rid, table, slot in work.requests:
            state = self._seqs.get(rid)
            if state is None or not state.tokens or state.features is None or slot is None:
                continue
            last = state.start + len(state.tokens) - 1  # the last prompt position
            self.slot_features[slot].copy_(state.features[-1])
            is_written = True
            if state.synced <= last:
                seq = ScheduledSeq(rid, [state.tokens[-1]], last, table, slot, is_prefill=False, sample=False)
                row, feats = self._catch_up(seq, table)
                rows.append(row)
                features.append(feats)
        if rows:
            self._forward(rows, self.model.fuse(torch.cat(features)), None)
        if is_written and self.device.type == "cuda":  # the KV sender reads these pages and rows once this returns
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> KdaRecord | None:
        """Catch the drafter up on every scheduled sequence and write each speculating sequence's
        drafts into its ``token_ids[1:]`` (see the module docstring). No KDA record: ``None``."""
        if not out.seqs:
            return None
        seqs = [replace(s, block_table=self._pages.full_row_table(s.request_id)) for s in out.seqs]
        forgotten, self._forgotten = self._forgotten, []
        drafts = self._run_announced(HiddenStep(seqs, forgotten))
        if not drafts:
            return None
        spec = [i for i, s in enumerate(out.seqs) if s.num_draft_tokens]
        host = torch.cat(drafts).tolist()
        at = 0
        for j in range(len(drafts)):
            for i in spec:
                if out.seqs[i].num_draft_tokens > j:
                    out.seqs[i].token_ids[1 + j] = host[at]
                    at += 1
        return None

    def _step(self, work: HiddenStep) -> list[torch.Tensor]:
        """A step's forwards (module docstring); the drafts of each draft forward."""
        self.forget(work.forgotten)
        seqs = work.seqs
        rows, features = [], []
        for seq in seqs:
            row, feats = self._catch_up(seq, seq.block_table)
            rows.append(row)
            features.append(feats)
        spec = [i for i, s in enumerate(seqs) if s.num_draft_tokens]
        hidden, tokens = self._forward(rows, self.model.fuse(torch.cat(features)), None)
        if not spec:
            return []
        drafts, live = [tokens], spec
        for j in range(1, max(seqs[i].num_draft_tokens for i in spec)):
            keep = [k for k, i in enumerate(live) if seqs[i].num_draft_tokens > j]
            live = [live[k] for k in keep]
            index = torch.tensor(keep, device=hidden.device)
            step = [_draft_row(seqs[i], j, seqs[i].block_table) for i in live]
            hidden, tokens = self._forward(step, hidden.index_select(0, index), tokens.index_select(0, index))
            drafts.append(tokens)
        return drafts

    def _catch_up(self, seq: ScheduledSeq, table: list[int]) -> tuple[ScheduledSeq, torch.Tensor]:
        """The catch-up rows of ``seq`` (positions ``synced .. context_len``, on the drafter's
        block ``table``) and their features."""
        state = self._seqs.setdefault(seq.request_id, _SeqState())
        c = seq.context_len
        if c < state.synced:  # recomputed from an earlier position (preemption): start over there
            state.synced, state.start, state.tokens, state.features = c, c, [], None
        first, last = state.synced - state.start, c - state.start  # rows of the kept tokens
        assert 0 <= first and last <= len(state.tokens), (
            f"request {seq.request_id}: drafter at {state.synced}, target rows {state.start}.."
            f"{state.start + len(state.tokens)}, context {c}")
        tokens = state.tokens[first:last] + seq.token_ids[:1]
        feats = torch.zeros(len(tokens), self._num_features, dtype=self.model.dtype, device=self.device)
        have = max(first - 1, 0)  # the feature of position p is row p - start; none before start
        if state.features is not None and last > have:
            feats[len(tokens) - (last - have):] = state.features[have:last]
        row = ScheduledSeq(seq.request_id, tokens, state.synced, table, seq.slot,
                           is_prefill=len(tokens) > 1, sample=seq.num_draft_tokens > 0)
        state.synced, state.start, state.tokens, state.features = c + 1, c, [], None
        return row, feats

    def record(self, out: SchedulerOutput, batch: ForwardBatch) -> None:
        """After the target's forward of ``out`` (``batch``'s rows in ``out``'s order): keep each
        sequence's tokens and layer outputs for its next catch-up."""
        assert batch.hidden_capture is not None, "the target forward kept no hidden states"
        features = batch.hidden_capture.features()
        at = 0
        for seq in out.seqs:
            state = self._seqs.setdefault(seq.request_id, _SeqState())
            state.start, state.tokens = seq.context_len, list(seq.token_ids)
            state.features = features[at: at + seq.num_tokens]
            at += seq.num_tokens

    def _forward(self, seqs: list[ScheduledSeq], fused: torch.Tensor, input_tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward; returns the outputs of its sampled rows and their argmax tokens."""
        batch = build_forward_batch(SchedulerOutput(seqs=seqs), self.device)
        if input_tokens is not None:
            batch.input_ids.copy_(input_tokens)
        hidden = self.model(batch, self.caches, fused)
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        tokens = self.model.logits(hidden).argmax(dim=-1) if hidden.shape[0] else hidden.new_zeros(0, dtype=torch.int64)
        return hidden, tokens

    def rollback(self, out: SchedulerOutput, record: KdaRecord, get_request: Callable[[str], Request | None]) -> None:
        """Nothing to roll back: the drafter has no KDA state (its rejected rows are rewritten)."""

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished or aborted requests' rows (and a received prompt cache not started); a
        heads-TP leader's group drops them with its next step."""
        if self.announce is not None:
            self._forgotten.extend(request_ids)
        for rid in request_ids:
            self._seqs.pop(rid, None)
            if self.prompt_cache is not None:
                self.prompt_cache.received.discard(rid)


def _draft_row(seq: ScheduledSeq, j: int, table: list[int]) -> ScheduledSeq:
    """Forward ``j``'s row of a speculating sequence: draft ``j`` at position ``context_len + j``
    (its token comes from the previous forward; the drafter's block ``table``), sampled."""
    return ScheduledSeq(seq.request_id, [0], seq.context_len + j, table, seq.slot, is_prefill=False,
                        sample=True)
