"""No Python garbage collection while a CUDA graph is being captured.

A collection that runs during a capture may destroy an unreachable object holding CUDA resources
(a tensor mapped from another process over CUDA IPC, an event, an earlier graph) and so call a
CUDA API that is not allowed while a stream captures; the process then aborts. Seen on an H200:
the GPU transceiver tests aborted in ``unit_graphs`` with "Fatal Python error: Aborted" under
"Garbage-collecting" inside a captured launch, the garbage being an earlier test's receiver.
``torch.cuda.graph`` collects once before it captures but leaves the collector on, so a capture
that allocates Python objects (Triton's launcher does) can still trigger one.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_collection() -> Iterator[None]:
    """Collect now, then keep the collector off until the block ends (restored as it was, also
    on an exception). Wrap every CUDA graph capture (with the launches it records) in it."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
