"""Model runner: turns a :class:`SchedulerOutput` into a :class:`ForwardBatch`, runs the model and
samples. It owns the model, the cache tensors and the sampler; it never touches queues.

A step is prepared (:meth:`ModelRunner.prepare_step`: each sampled request's sampling, the
batch) before any model code runs; a failure there is a :class:`StepPreparationError` naming the
requests it is traced to, and leaves the caches (and, in a world, the other ranks) untouched, so
the step can run again without them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.engine.cuda_graphs import VERIFY_GRAPH_ROWS, DecodeGraphs
from helixserve.engine.request import SamplingParams
from helixserve.engine.sampler import Sampler
from helixserve.engine.scheduler import SchedulerOutput
from helixserve.engine.spec.verify_step import VerifiedStep, kda_record, verify_step
from helixserve.host_copy import to_device
from helixserve.kvcache.pools import copy_states, reset_slots
from helixserve.models.context import ForwardBatch
from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.kda_checkpoints import StateSaves, build_state_saves
from helixserve.models.kda_spec import KdaRecord

logger = logging.getLogger(__name__)


def build_forward_batch(out: SchedulerOutput, device: torch.device | str = "cpu") -> ForwardBatch:
    """Flatten the scheduled sequences; logits are wanted for the last row of sampled sequences
    (every row of a speculating one, :mod:`helixserve.engine.spec.verify_step`):
    ``logits_indices`` is ``None`` when that is every row (a decode step: no gather before the LM
    head) and empty when it is no row (only unsampled prompt chunks: no LM head at all)."""
    input_ids: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    logits_rows: list[int] = []
    max_blocks = max((len(s.block_table) for s in out.seqs), default=0)
    tables = []
    for s in out.seqs:
        n = s.num_tokens
        input_ids.extend(s.token_ids)
        positions.extend(range(s.context_len, s.context_len + n))
        cu_seqlens.append(cu_seqlens[-1] + n)
        if s.sample:  # a speculating sequence's every row (its verify rows), else the last
            logits_rows.extend(range(cu_seqlens[-1] - 1 - s.num_draft_tokens, cu_seqlens[-1]))
        tables.append(list(s.block_table) + [-1] * (max_blocks - len(s.block_table)))

    is_every_row = 0 < len(logits_rows) == len(input_ids)
    if is_every_row:
        logits_rows = []
    context_lens = [s.context_len for s in out.seqs]
    slots = [s.slot if s.slot is not None else 0 for s in out.seqs]
    # the int64 metadata as views of one tensor: one host -> tensor conversion (and one copy to a
    # device); each part starts on a 16-byte boundary (padded to an even length), so the views'
    # alignment does not depend on the row and sequence counts: Triton specializes pointer
    # arguments on 16-byte alignment, and a count-dependent alignment compiled a new kernel
    # variant for the first request of some lengths (warm-up cannot reach them all)
    parts = (input_ids, positions, cu_seqlens, context_lens, slots, logits_rows)
    padded = [p + [0] * (len(p) % 2) for p in parts]
    flat = to_device(torch.tensor(list(itertools.chain.from_iterable(padded)), dtype=torch.int64), device)
    ids_t, positions_t, cu_t, context_t, slots_t, logits_t = (
        view[:len(p)] for view, p in zip(flat.split_with_sizes([len(q) for q in padded]), parts))
    block_tables = to_device(torch.tensor(tables, dtype=torch.int32), device).reshape(len(out.seqs), max_blocks)
    return ForwardBatch(
        input_ids=ids_t,
        positions=positions_t,
        cu_seqlens=cu_t,
        context_lens=context_t,
        block_tables=block_tables,
        state_slots=slots_t,
        logits_indices=None if is_every_row else logits_t,
        is_decode=bool(out.seqs) and all(s.num_tokens == 1 and s.context_len > 0 for s in out.seqs),
    )


def slot_order(out: SchedulerOutput) -> list[int] | None:
    """For a decode step (one sampled token per sequence) whose state slots are a consecutive range
    in another order (the allocator hands freed slots back last-freed first): the sequence order
    that sorts the slots, so the KDA and conv state rows are one slice of the pools. ``None`` when
    the slots already ascend, are not a consecutive range, or the step is not a pure decode."""
    seqs = out.seqs
    slots = [s.slot for s in seqs]
    if len(seqs) < 2 or None in slots or any(s.num_tokens != 1 or not s.sample for s in seqs):
        return None
    first = min(slots)
    if slots == list(range(first, first + len(slots))) or sorted(slots) != list(range(first, first + len(slots))):
        return None
    return sorted(range(len(seqs)), key=slots.__getitem__)


def inner_state_saves(out: SchedulerOutput, pools: ModelCaches, device: torch.device | str) -> StateSaves | None:
    """The KDA state checkpoints ``out``'s prefill chunks take inside them (``None``: none)."""
    if not any(s.inner_saves for s in out.seqs):
        return None
    firsts = itertools.accumulate((s.num_tokens for s in out.seqs), initial=0)
    return build_state_saves([(first, s.num_tokens, s.inner_saves) for first, s in zip(firsts, out.seqs)], pools, device)


def _capture_failed(exc: RuntimeError, what: str) -> str:
    """The reason a graph capture failed (its first line), logged once as a WARNING after ``what``."""
    first_line = next(iter(str(exc).strip().splitlines()), "")
    reason = f"capture failed: {type(exc).__name__}: {first_line}"
    logger.warning("%s: %s", what, reason)
    return reason


class StepPreparationError(Exception):
    """A step failed before any model code ran. ``failures``: request id -> why, for each request
    the failure is traced to (empty: not traced to any)."""

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


@dataclass(slots=True)
class PreparedStep:
    """A step's batch (rows in slot order when that order differs), the state slots to zero
    first, and the scheduled order of the logits rows (``None``: the batch's own)."""

    batch: ForwardBatch
    reset_slot_ids: list[int]
    inverse: list[int] | None
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint, slot), before
    state_saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, checkpoint), after


@dataclass(slots=True)
class LaunchedStep:
    """A step enqueued on the device: ``tokens`` (device, one per id of ``sampled_ids``) feed an
    overlapped next step; ``result()`` waits for their copy to the host only (not for work
    enqueued after the step). A step with drafts has its verified runs instead (no ``tokens``:
    no step overlaps it)."""

    sampled_ids: list[str]
    tokens: torch.Tensor | None
    host_tokens: torch.Tensor | None
    copied: torch.cuda.Event | None
    verified: VerifiedStep | None = None  # a step with drafts: its runs, read back already
    kda_record: KdaRecord | None = None  # its speculating sequences' KDA record
    draft_record: KdaRecord | None = None  # the draft model's KDA record of them (method draft)

    def result(self) -> dict[str, int] | dict[str, list[int]]:
        if self.verified is not None:
            return self.verified.runs
        if self.host_tokens is None:
            return {}
        if self.copied is not None:
            self.copied.synchronize()
        return dict(zip(self.sampled_ids, self.host_tokens.tolist(), strict=True))


class ModelRunner:
    """Runs one scheduled step: reset fresh state slots, forward, sample the sampled rows."""

    def __init__(self, model: torch.nn.Module, caches: ModelCaches, device: torch.device | str, seed: int = 0) -> None:
        self.model = model
        self.caches = caches
        self.device = torch.device(device)
        self.sampler = Sampler(self.device, seed=seed)
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: dict[int, DecodeGraphs] = {}  # rows per sequence -> verify steps' graphs
        self.checkpoints: ModelCaches | None = None  # KDA state checkpoints (prefix caching)
        self.replayed_record: KdaRecord | None = None  # the last graphed verify step's KDA record
        self._replayed_from: DecodeGraphs | None = None  # the graphs that replayed it
        self.capture_layers: tuple[int, ...] | None = None  # layers whose outputs every step keeps

    def capture_decode_graphs(self, max_batch: int, max_blocks: int, scratch_slot: int) -> str | None:
        """CUDA-graph the decode steps of up to ``max_batch`` sequences (see :mod:`.cuda_graphs`);
        ``scratch_slot``: a state slot no request owns, for the padding rows. A capture that fails
        (an op a graph cannot hold, memory) leaves decode eager: one WARNING with the reason, which
        is also returned (``None``: captured)."""
        try:
            graphs = DecodeGraphs(self.model, self.caches, self.device, max_batch, max_blocks, scratch_slot)
            graphs.capture()
        except RuntimeError as exc:  # torch.AcceleratorError and torch.OutOfMemoryError are RuntimeErrors
            self.decode_graphs = None
            return _capture_failed(exc, "decode CUDA graphs off, decode runs eagerly")
        self.decode_graphs = graphs
        return None

    def capture_verify_graphs(self, num_draft_tokens: int, max_batch: int, max_blocks: int,
                              scratch_slot: int) -> str | None:
        """CUDA-graph the verify steps of up to ``max_batch`` sequences (and ``VERIFY_GRAPH_ROWS`` rows)
        with 1 .. ``num_draft_tokens`` drafts each, a step's sequences padded to its longest (see
        :mod:`.cuda_graphs`), and their rollbacks, in one memory pool of their own. A failed capture leaves verify steps eager: one WARNING, the
        reason returned (``None``: captured)."""
        graphs: dict[int, DecodeGraphs] = {}
        pool = None
        try:
            for rows in range(num_draft_tokens + 1, 1, -1):  # the largest first, in one pool
                most = max(1, min(max_batch, VERIFY_GRAPH_ROWS // rows))
                graphs[rows] = DecodeGraphs(self.model, self.caches, self.device, most, max_blocks, scratch_slot,
                                            rows_per_seq=rows, pool=pool)
                graphs[rows].capture()
                pool = graphs[rows].pool
        except RuntimeError as exc:  # as capture_decode_graphs
            return _capture_failed(exc, "verify CUDA graphs off, verify steps run eagerly")
        self.verify_graphs = graphs
        return None

    def graphs_for(self, out: SchedulerOutput, input_tokens: torch.Tensor | None = None) -> DecodeGraphs | None:
        """The captured graphs a step replays (``None``: it runs eagerly)."""
        if out.num_draft_tokens:  # the fewest rows per sequence that hold the step's longest
            rows = max(s.num_tokens for s in out.seqs)
            graphs = self.verify_graphs.get(rows) if input_tokens is None else None
        else:
            graphs = self.decode_graphs
        return graphs if graphs is not None and graphs.fits(out) else None

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[num sampled rows, vocab]`` fp32 for one step. ``input_tokens``: the input ids of
        a decode step (one per sequence, on the device) in place of the sequences' ``token_ids``."""
        if self.graphs_for(out, input_tokens) is None:
            return self.run(self.prepare(out, input_tokens))
        return self.run_step(out, None, input_tokens)

    def prepare(self, out: SchedulerOutput, input_tokens: torch.Tensor | None = None) -> PreparedStep:
        """The step's batch, built on the device (no model code runs: a failure here leaves the
        caches and, in a world, the other ranks untouched).

        A decode step whose slots are a permuted range runs in slot order: the model updates the
        slots' KDA/conv state rows in place (a view of the pools) instead of gathering and
        scattering them; the logits go back to the scheduled order. With ``capture_layers`` the
        rows keep the scheduled order and the batch keeps those layers' outputs (a hidden-state
        drafter's features)."""
        order = slot_order(out) if self.capture_layers is None else None
        by_slot = out if order is None else SchedulerOutput(seqs=[out.seqs[i] for i in order])
        batch = build_forward_batch(by_slot, self.device)
        if self.checkpoints is not None:
            batch.state_saves = inner_state_saves(by_slot, self.checkpoints, self.device)
        if out.num_draft_tokens and self.caches.kda_state:
            batch.kda_record = kda_record(out, self.device)
        if self.capture_layers is not None:
            batch.hidden_capture = HiddenCapture(self.capture_layers)
        if input_tokens is not None:
            if order is not None:
                input_tokens = input_tokens[to_device(torch.tensor(order), input_tokens.device)]
            batch.input_ids.copy_(input_tokens)
        inverse = None
        if order is not None:
            inverse = [0] * len(order)
            for row, i in enumerate(order):
                inverse[i] = row
        return PreparedStep(batch, out.reset_slot_ids, inverse, out.state_restores, out.state_saves)

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> torch.Tensor:
        """Reset the fresh state slots and run the model on a prepared batch."""
        if prepared.reset_slot_ids:
            reset_slots(self.caches, prepared.reset_slot_ids)
        self.restore_states(prepared.state_restores)
        logits = self.model(prepared.batch, self.caches)
        self.save_states(prepared.state_saves)
        if prepared.inverse is None:
            return logits
        return logits.index_select(0, to_device(torch.tensor(prepared.inverse), logits.device))

    def prepare_step(
        self, out: SchedulerOutput, params: Mapping[str, SamplingParams], input_tokens: torch.Tensor | None = None,
    ) -> PreparedStep | None:
        """What a step needs before the model runs: each sampled request's sampling
        (:meth:`Sampler.check`) and the batch (``None``: a captured decode graph builds its own).
        :class:`StepPreparationError` when one of them cannot be built; nothing has run then."""
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        failures = self.sampler.check(sampled_ids, [params[r] for r in sampled_ids])
        if failures:
            raise StepPreparationError(f"sampling could not be set up for {sorted(failures)}", failures)
        if self.graphs_for(out, input_tokens) is not None:
            return None
        try:
            return self.prepare(out, input_tokens)
        except Exception as exc:
            raise StepPreparationError(f"{type(exc).__name__}: {exc}") from exc

    @torch.inference_mode()
    def run_step(self, out: SchedulerOutput, prepared: PreparedStep | None,
                 input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of a step :meth:`prepare_step` prepared (``None``: its graph's; a verify
        step's KDA record is :attr:`replayed_record` then)."""
        if prepared is not None:
            return self.run(prepared)
        graphs = self.graphs_for(out, input_tokens)
        assert graphs is not None, "prepare_step found the step fits captured graphs"
        if out.reset_slot_ids:
            reset_slots(self.caches, out.reset_slot_ids)
        self.restore_states(out.state_restores)  # a one-token final chunk after a cached prefix fits too
        logits = graphs.run(out, input_tokens)
        assert logits is not None
        self.replayed_record, self._replayed_from = graphs.record, graphs
        self.save_states(out.state_saves)
        return logits

    def restore_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KDA state checkpoints into slots: ``(checkpoint, slot)`` pairs."""
        if self.checkpoints is not None:
            copy_states(self.checkpoints, self.caches, pairs)

    def save_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slots' KDA states into checkpoints: ``(slot, checkpoint)`` pairs."""
        if self.checkpoints is not None:
            copy_states(self.caches, self.checkpoints, pairs)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor, params: Mapping[str, SamplingParams]) -> LaunchedStep:
        """Sample ``out``'s sampled rows from ``logits`` and enqueue the tokens' copy to the host."""
        sampled_ids = [s.request_id for s in out.seqs if s.sample]
        if not sampled_ids:  # only unsampled prompt chunks: the caches were written, nothing to draw
            return LaunchedStep([], None, None, None)
        if out.num_draft_tokens:
            return LaunchedStep(sampled_ids, None, None, None, verify_step(self.sampler, out, logits, params))
        return self.launched(sampled_ids, self.sampler.launch(logits, sampled_ids, [params[r] for r in sampled_ids]))

    def launched(self, sampled_ids: list[str], tokens: torch.Tensor) -> LaunchedStep:
        """``tokens`` (on the device) as a step whose copy to the host is enqueued."""
        if self.device.type != "cuda":
            return LaunchedStep(sampled_ids, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedStep(sampled_ids, tokens, host, copied)

    @torch.inference_mode()
    def rollback(self, record: KdaRecord, keep: dict[int, int]) -> None:
        """Roll the KDA state of a verify step's speculating sequences back to their kept rows
        (``keep``: index into ``record``'s sequences -> rows kept, fewer than it ran)."""
        if not keep:
            return
        if self._replayed_from is not None and record is self.replayed_record:
            self._replayed_from.roll_back(keep)  # the verify graph's own rollback graph
            return
        for mixer in self.model.kda_mixers():
            mixer.rollback(self.caches, record, keep)

    def release(self, request_ids: list[str]) -> None:
        self.sampler.release(request_ids)
