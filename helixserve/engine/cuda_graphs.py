"""CUDA graphs of decode steps (one new token per sequence) for a ladder of batch sizes.

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
"""

from __future__ import annotations

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.engine.scheduler import SchedulerOutput
from helixserve.host_copy import to_device
from helixserve.kernels.capture import no_collection
from helixserve.models.context import ForwardBatch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_WARMUP_RUNS = 2


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``caches``; :meth:`run` returns ``None`` when a step
    does not fit (not pure decode, too many sequences, a table wider than ``max_blocks``)."""

    def __init__(
        self, model: torch.nn.Module, caches: ModelCaches, device: torch.device, max_batch: int,
        max_blocks: int, scratch_slot: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    ) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.sizes = sorted({s for s in batch_sizes if s < max_batch} | {max_batch})
        self.max_blocks, self.scratch_slot = max(1, max_blocks), scratch_slot
        n = self.sizes[-1]
        # rows of `ints`: input ids, positions, context lens, state slots
        self._ints = torch.zeros(4, n, dtype=torch.int64, device=device)
        self._ints[3].fill_(scratch_slot)
        self._tables = torch.full((n, self.max_blocks), -1, dtype=torch.int32, device=device)
        self._cu = torch.arange(n + 1, dtype=torch.int64, device=device)
        self._host_ints = torch.zeros(4, n, dtype=torch.int64, pin_memory=True)
        self._host_tables = torch.full((n, self.max_blocks), -1, dtype=torch.int32, pin_memory=True)
        # the table list each host row was last written from (None: padding or never written)
        self._row_tables: list[list[int] | None] = [None] * n
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _batch(self, n: int) -> ForwardBatch:
        ids, positions, context_lens, slots = self._ints[:, :n]
        return ForwardBatch(
            input_ids=ids, positions=positions, cu_seqlens=self._cu[: n + 1], context_lens=context_lens,
            block_tables=self._tables[:n], state_slots=slots, logits_indices=self._cu[:n], is_decode=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (Triton compiles, autotunes) and capture every size, largest first, in one pool
        (no garbage collection meanwhile: see `kernels.capture`)."""
        with no_collection():
            self._capture_all()
        torch.cuda.synchronize(self.device)

    def _capture_all(self) -> None:
        pool = None
        for n in reversed(self.sizes):
            batch = self._batch(n)  # all rows padding: nothing outside the scratch slot is touched
            for _ in range(_WARMUP_RUNS):
                self.model(batch, self.caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(batch, self.caches)
            pool = graph.pool()
            self._graphs[n] = (graph, logits)

    def fits(self, out: SchedulerOutput) -> bool:
        """A pure decode step of at most the largest captured size, its tables within
        ``max_blocks`` (what :meth:`run` replays). In a world every rank of a CP group answers
        alike: same sequences, and each rank's share of a table is no wider than the whole."""
        seqs = out.seqs
        return (0 < len(seqs) <= self.sizes[-1] and all(s.num_tokens == 1 and s.context_len > 0 for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.max_blocks)

    def run(self, out: SchedulerOutput, input_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[num sampled seqs, vocab]`` of a decode step, or ``None`` to run it eagerly.
        ``input_tokens``: the step's input ids on the device (an overlapped step's, whose
        ``token_ids`` are placeholders), copied in after the host buffers."""
        if not self.fits(out):
            return None
        seqs = out.seqs
        n = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        size = next(s for s in self.sizes if s >= n)
        self._copied.synchronize()  # the last step's copies have left the host buffers
        ints = self._host_ints.numpy()
        ints[0, :n] = [s.token_ids[0] for s in seqs]
        ints[1, :n] = ints[2, :n] = [s.context_len for s in seqs]
        ints[3, :n] = [self.scratch_slot if s.slot is None else s.slot for s in seqs]
        ints[:3, n:size] = 0
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
        logits = self.launch(size, input_tokens)
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        if len(sampled) == n:
            return logits[:n]
        if not sampled:  # one-token prompt chunks that are not a prompt's last: no row to sample
            return logits[:0]
        return logits[to_device(torch.tensor(sampled, dtype=torch.int64), self.device)]

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
        return logits
