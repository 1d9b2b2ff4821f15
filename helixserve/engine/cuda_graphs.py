"""CUDA graphs of decode steps (one new token per sequence) and of verify steps (a speculating
sequence's last token and its drafts, ``R`` rows per sequence) for a ladder of batch sizes.

A decode step of ``n`` sequences replays the graph of the smallest captured size ``>= n``. The
graphs read static device buffers (token ids, positions, context lengths, block tables, state
slots); a replay fills them from the scheduled sequences with one host-to-device copy per buffer
and pads the unused rows with an empty sequence: context 0, block table all ``-1`` (nothing
written, no key attended) and a scratch state slot that no request owns (the cache pools hold one
slot more than the cache manager hands out). Every kernel of a decode step is free of host syncs,
so a step costs one ``replay()`` plus the copies.

Block-table columns past a row's own table may hold stale entries of earlier steps: a decode row
reads only the columns its ``kv_len`` covers, so the copies carry just the batch's widest table.
A row is rewritten on the host only when its table changed: the cache handle returns the same
list object until a block is added (``CacheHandle.block_table``), so a step inside the rows'
last blocks converts no table at all.

**Verify steps** (``rows_per_seq`` R > 1; :mod:`helixserve.engine.spec`): a step whose every
sequence continues its cache with at most ``R - 1`` drafts (a decode beside verify rows has none)
replays the graph of R rows per sequence. Its rows are flat (sequence after sequence,
``cu_seqlens = R * arange``) and its KDA layers run row by row into a static
:class:`~helixserve.models.kda_spec.KdaRecord` captured with the graph (its saved inputs and
pre-step states are graph outputs, rewritten by each replay): the rollback after verification
reads them before any graph replays again, since no step is enqueued ahead of a verify step.

A sequence with fewer rows than R is padded with its last token: its extra rows write their keys
at its next positions (in its own blocks, rewritten by the step that computes those tokens before
anything reads them; past its table the columns are ``-1``, nothing written), their logits are
not read, and the KDA state they advanced is rolled back with the rejected drafts' (the record
counts R rows for every sequence, so ``kept_rows`` replays the rows the sequence keeps). Padding
sequences are R rows of an empty sequence, as for decode. Steps with prompt chunks run eagerly.

The rollback of a verify replay is a graph too (:meth:`DecodeGraphs.roll_back`), captured per
size beside its verify graph and reading that graph's record: every sequence is restored and
advanced over R - 1 rows at fixed shapes, those that keep all their rows (or fewer than R - 1)
naming the scratch slot where they are not rolled back (``kda_spec.replay_all``). An eager
rollback launches a few kernels per KDA layer and kept row, which at batch 1 cost about as much
as the verify step.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.engine.scheduler import SchedulerOutput
from helixserve.host_copy import to_device
from helixserve.kernels.capture import no_collection
from helixserve.models.context import ForwardBatch
from helixserve.models.kda_spec import KdaRecord, replay_all

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_WARMUP_RUNS = 2
VERIFY_GRAPH_ROWS = 512  # verify graphs hold at most this many rows (sequences x rows per sequence)


class DecodeGraphs:
    """Captured decode steps (``rows_per_seq`` 1) or verify steps (``rows_per_seq`` R > 1) of
    ``model`` over ``caches``; :meth:`run` returns ``None`` when a step does not fit (not of this
    shape, too many sequences, a table wider than ``max_blocks``). ``pool``: a memory pool to
    capture in (``None``: a new one, :attr:`pool` after :meth:`capture`)."""

    def __init__(
        self, model: torch.nn.Module, caches: ModelCaches, device: torch.device, max_batch: int,
        max_blocks: int, scratch_slot: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        rows_per_seq: int = 1, pool: tuple[int, int] | None = None,
    ) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.sizes = sorted({s for s in batch_sizes if s < max_batch} | {max_batch})
        self.max_blocks, self.scratch_slot = max(1, max_blocks), scratch_slot
        self.rows_per_seq, self.pool = rows_per_seq, pool
        n, R = self.sizes[-1], rows_per_seq
        # rows of `ints`: input ids, positions (n R of each), context lens, state slots (n of each)
        self._ints = torch.zeros(4, n * R, dtype=torch.int64, device=device)
        self._ints[3].fill_(scratch_slot)
        self._tables = torch.full((n, self.max_blocks), -1, dtype=torch.int32, device=device)
        self._cu = torch.arange(0, R * (n + 1), R, dtype=torch.int64, device=device)
        self._host_ints = torch.zeros(4, n * R, dtype=torch.int64, pin_memory=True)
        self._host_tables = torch.full((n, self.max_blocks), -1, dtype=torch.int32, pin_memory=True)
        # the table list each host row was last written from (None: padding or never written)
        self._row_tables: list[list[int] | None] = [None] * n
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._records: dict[int, KdaRecord] = {}  # verify graphs of a model with KDA layers: per size
        self.record: KdaRecord | None = None  # the last verify replay's, for its rollback
        self.num_replays = 0
        # the rollback of a verify graph's rejected rows (see the module docstring): per size, a
        # graph reading `_rollback_slots` (row 0: each sequence's restore slot, row 1 + j: the
        # slot it advances at kept row j; the scratch slot where it does not)
        self._rollbacks: dict[int, torch.cuda.CUDAGraph] = {}
        self._rollback_slots = torch.full((R, n), scratch_slot, dtype=torch.int64, device=device)
        self._host_rollback_slots = torch.full((R, n), scratch_slot, dtype=torch.int64, pin_memory=True)
        self._rolled = torch.cuda.Event()
        self._rolled.record()
        self._last: tuple[int, list[int]] = (0, [])  # the last verify replay's size and slots
        self.num_rollbacks = 0

    def _batch(self, n: int) -> ForwardBatch:
        R = self.rows_per_seq
        ids, positions = self._ints[:2, : n * R]
        context_lens, slots = self._ints[2:, :n]
        batch = ForwardBatch(
            input_ids=ids, positions=positions, cu_seqlens=self._cu[: n + 1], context_lens=context_lens,
            block_tables=self._tables[:n], state_slots=slots, logits_indices=self._cu[:n] if R == 1 else None,
            is_decode=R == 1,
        )
        if R > 1 and self.caches.kda_state:
            batch.kda_record = self._records.setdefault(n, self._static_record(n, slots))
        return batch

    def _static_record(self, n: int, slots: torch.Tensor) -> KdaRecord:
        """A verify step's KDA record over ``n`` sequences of R rows each, row by row (every
        sequence speculates; its tensors live as long as the graph)."""
        R, device = self.rows_per_seq, self.device
        seqs = torch.arange(n, dtype=torch.int64, device=device)
        steps = [(seqs * R + j, slots) for j in range(R)]
        return KdaRecord(seqs, torch.arange(n * R, dtype=torch.int64, device=device), list(range(0, n * R, R)),
                         [R] * n, slots, list(range(n)), steps)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (Triton compiles, autotunes) and capture every size, largest first, in one pool
        (no garbage collection meanwhile: see `kernels.capture`)."""
        with no_collection():
            self._capture_all()
        torch.cuda.synchronize(self.device)

    def _capture_all(self) -> None:
        for n in reversed(self.sizes):
            batch = self._batch(n)  # all rows padding: nothing outside the scratch slot is touched
            for _ in range(_WARMUP_RUNS):
                self.model(batch, self.caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model(batch, self.caches)
            self.pool = graph.pool()
            self._graphs[n] = (graph, logits)
            if batch.kda_record is not None:
                self._capture_rollback(n, batch.kda_record)

    def _capture_rollback(self, n: int, record: KdaRecord) -> None:
        """The rollback graph of the verify graph of size ``n``: it reads that graph's record (its
        saved inputs and pre-step states) and every slot from ``_rollback_slots`` (all scratch
        while capturing: nothing a request owns is touched)."""
        R = self.rows_per_seq
        restore, *advance_slots = self._rollback_slots[:, :n]
        steps = [(record.steps[j][0], advance_slots[j]) for j in range(R - 1)]

        def roll_back() -> None:
            for mixer in self.model.kda_mixers():
                replay_all(mixer, record.layers[mixer.layer_idx], self.caches.conv_state[mixer.layer_idx],
                           self.caches.kda_state[mixer.layer_idx], restore, steps)

        roll_back()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            roll_back()
        self._rollbacks[n] = graph

    def fits(self, out: SchedulerOutput) -> bool:
        """A step of this shape (pure decode; or every sequence verifying R - 1 drafts) of at most
        the largest captured size, its tables within ``max_blocks`` (what :meth:`run` replays). In
        a world every rank of a CP group answers alike: same sequences, and each rank's share of a
        table is no wider than the whole."""
        seqs, R = out.seqs, self.rows_per_seq
        if not 0 < len(seqs) <= self.sizes[-1] or max(len(s.block_table) for s in seqs) > self.max_blocks:
            return False
        if R == 1:
            return all(s.num_tokens == 1 and s.context_len > 0 for s in seqs)
        last = self.max_blocks * self.caches.tokens_per_block  # padded rows' positions stay in the tables
        return all(s.num_tokens == 1 + s.num_draft_tokens <= R and s.sample and 0 < s.context_len
                   and s.context_len + R <= last and s.slot is not None and not s.inner_saves for s in seqs)

    def run(self, out: SchedulerOutput, input_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[num sampled rows, vocab]`` of a step, or ``None`` to run it eagerly.
        ``input_tokens``: the step's input ids on the device (an overlapped decode step's, whose
        ``token_ids`` are placeholders), copied in after the host buffers. A verify step's KDA
        record is :attr:`record` afterwards (its first ``len(out.seqs)`` sequences)."""
        if not self.fits(out) or (input_tokens is not None and self.rows_per_seq > 1):
            return None
        seqs, R = out.seqs, self.rows_per_seq
        n = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        size = next(s for s in self.sizes if s >= n)
        self._copied.synchronize()  # the last step's copies have left the host buffers
        ints = self._host_ints.numpy()
        if R == 1:
            ints[0, :n] = [s.token_ids[0] for s in seqs]
            ints[1, :n] = ints[2, :n] = [s.context_len for s in seqs]
        else:  # a sequence with fewer rows repeats its last token (rows nobody reads)
            ints[0, : n * R] = [t for s in seqs for t in s.token_ids + s.token_ids[-1:] * (R - s.num_tokens)]
            ints[1, : n * R] = [s.context_len + j for s in seqs for j in range(R)]
            ints[2, :n] = [s.context_len for s in seqs]
        ints[3, :n] = [self.scratch_slot if s.slot is None else s.slot for s in seqs]
        ints[:2, n * R: size * R] = 0
        ints[2, n:size] = 0
        ints[3, n:size] = self.scratch_slot
        tables = self._host_tables.numpy()
        written = self._row_tables
        for i, s in enumerate(seqs):
            table = s.block_table
            if written[i] is not table:
                tables[i, : len(table)] = table
                written[i] = table
        tables[n:size, :width] = -1
        written[n:size] = [None] * (size - n)
        if R > 1:  # the columns a row's extra rows reach past its own table: nothing written there
            tpb = self.caches.tokens_per_block
            for i, s in enumerate(seqs):
                reach = -(-(s.context_len + R) // tpb)
                if reach > len(s.block_table):
                    tables[i, len(s.block_table): reach] = -1
        logits = self.launch(size, input_tokens)
        if R > 1:
            record = self._records.get(size)
            self.record = None if record is None else replace(record, batch_seqs=list(range(n)))
            self._last = (size, [s.slot for s in seqs])  # type: ignore[misc] - fits: every slot is set
            if all(s.num_tokens == R for s in seqs):
                return logits[: n * R]
            rows = [i * R + j for i, s in enumerate(seqs) for j in range(s.num_tokens)]
            return logits[to_device(torch.tensor(rows, dtype=torch.int64), self.device)]
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        if len(sampled) == n:
            return logits[:n]
        if not sampled:  # one-token prompt chunks that are not a prompt's last: no row to sample
            return logits[:0]
        return logits[to_device(torch.tensor(sampled, dtype=torch.int64), self.device)]

    def roll_back(self, keep: dict[int, int]) -> None:
        """Roll the last verify replay's sequences ``keep`` names (index -> rows kept, fewer than
        R) back to their kept rows: one replay of its size's rollback graph. Call it before the
        next replay of any graph of this pool (which rewrites the record it reads)."""
        size, slots = self._last
        R, scratch = self.rows_per_seq, self.scratch_slot
        self._rolled.synchronize()  # the last rollback's copy has left the host buffer
        host = self._host_rollback_slots.numpy()
        host[:, :size] = scratch
        for i, kept in keep.items():
            host[0, i] = slots[i]
            host[1: 1 + kept, i] = slots[i]
        self._rollback_slots.copy_(self._host_rollback_slots, non_blocking=True)
        self._rolled.record()
        self._rollbacks[size].replay()
        self.num_rollbacks += 1

    def launch(self, size: int, input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The GPU part of a step: copy the filled host buffers (the first ``size`` table rows),
        then ``input_tokens`` over the first input ids, and replay the graph of ``size``; returns
        its logits buffer."""
        # whole rows, contiguous on both sides: a strided copy goes through a pageable temporary,
        # which waits for the stream (the step in flight) before it starts
        self._ints.copy_(self._host_ints, non_blocking=True)
        self._tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        self._copied.record()
        if input_tokens is not None:
            self._ints[0, : input_tokens.shape[0]].copy_(input_tokens)
        graph, logits = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits
