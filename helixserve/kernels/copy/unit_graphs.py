"""CUDA graphs of the unit copy between fixed tensors (GPU only): Triton's launch cost paid once.

A pull issues one unit copy per request between the same two pool sets (`transceiver.gen.pull`).
Through Triton's launcher, with a fresh pinned upload of its request table, that cost about
0.2 ms of host time per request on an H200 host (`bench/transceiver.py --device cuda`, the
``copy_prepared`` stamps), more than the copy of a short prompt's shard takes on the device.

A :class:`UnitGraphs` keeps a few slots, each a pinned host buffer and a device buffer of a fixed
capacity and a captured graph of one launch of the copy kernel over a fixed grid reading its
request table from that device buffer (the kernel loops over the request's work items, so one
grid serves every request). A copy takes a free slot (:meth:`free_slot`), writes its request
table into the slot's pinned buffer, uploads it (one ``copy_`` of the table rounded up to a
power of two, views kept per size) and replays the slot's graph on the current stream
(:meth:`replay_slot`). A slot is free once the event recorded after its last use has passed:
until then its upload may not have run. When no slot is free, or the table does not fit one,
there is none and the caller launches directly (`triton_units.copy_prepared`, which also launches directly for 8-byte-word units, two
groups over one segments array, or a table whose capture failed). Capture uses the thread-local mode: ucxx's threads may
call CUDA meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from helixserve.kernels.capture import no_collection
from helixserve.kernels.copy import triton_units

SLOTS = 4  # pulls in flight at once through graphs (more launch directly)
CAPACITY_UNITS = 8192  # unit rows a slot's table holds (64-token pages: a 512k-token shard)
PROGRAMS_PER_SM = 8  # the fixed grid
MIN_UPLOAD_WORDS = 256  # the smallest upload of a request table (2 KiB)


@dataclass(slots=True)
class _Slot:
    host: torch.Tensor  # pinned
    view: np.ndarray  # of host
    table: torch.Tensor  # on the device, what the graph's kernel reads
    graph: torch.cuda.CUDAGraph
    event: torch.cuda.Event
    used: bool = False
    uploads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # words -> (host, device) views

    def upload_views(self, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (pinned, device) views of the first `words` words rounded up to a power of two
        (at least MIN_UPLOAD_WORDS, at most the capacity): a handful of sizes, made once."""
        size = min(max(1 << (words - 1).bit_length(), MIN_UPLOAD_WORDS), self.table.numel())
        views = self.uploads.get(size)
        if views is None:
            views = self.uploads[size] = (self.host[:size], self.table[:size])
        return views


class UnitGraphs:
    """Graphs of the 8-byte-word, 16-byte-vector unit copy of `num_groups` groups whose segment
    rows are `seg_rows` (a `triton_units.SegmentTable`'s), between the anchors `src` and `dst`."""

    def __init__(self, seg_rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_groups: int,
                 slots: int | None = None, capacity_units: int | None = None) -> None:
        device = dst.device
        slots, capacity_units = slots or SLOTS, capacity_units or CAPACITY_UNITS
        self.capacity = (num_groups + 1) * triton_units.HEADER + 2 * capacity_units
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
        self._slots: list[_Slot] = []
        self._next = 0
        self._refs = (seg_rows, src, dst)  # what the graphs read
        # the buffers belong to the stream the copies run on (not the capture's side stream)
        buffers = [(torch.zeros(self.capacity, dtype=torch.int64, pin_memory=True),
                    torch.zeros(self.capacity, dtype=torch.int64, device=device)) for _ in range(slots)]  # no work
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), no_collection():
            for host, table in buffers:

                def launch(table: torch.Tensor = table) -> None:
                    triton_units._launch(seg_rows, table, self.grid, 8, 2, num_groups, src, dst)

                launch()  # compiled and loaded before the capture
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
                self._slots.append(_Slot(host, host.numpy(), table, graph, torch.cuda.Event()))
        stream.synchronize()

    def free_slot(self, words: int) -> _Slot | None:
        """A slot whose last copy has ended and whose table holds `words`, or None: the caller
        then launches directly. Write the request table into its ``view``, then `replay_slot`."""
        if words > self.capacity:
            return None
        n = len(self._slots)
        for i in range(n):
            slot = self._slots[(self._next + i) % n]
            if slot.used and not slot.event.query():
                continue
            self._next = (self._next + i + 1) % n
            return slot
        return None

    def replay_slot(self, slot: _Slot, words: int, stream: torch.cuda.Stream | None = None) -> None:
        """Upload the first `words` words of `slot`'s table and replay its graph on the current
        stream (`stream`, when the caller has it at hand: the event is recorded on it)."""
        host, table = slot.upload_views(words)
        table.copy_(host, non_blocking=True)
        slot.graph.replay()
        slot.event.record(stream)
        slot.used = True
