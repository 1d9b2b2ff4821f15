"""Lease words: a ctx worker's shared-memory record of which granted pulls it still holds.

A granted pull (`PullGrant`, see `cuda_ipc` and `gen.granted_pull`) lets a gen rank on the same host copy
a request's blocks out of the ctx's opened pools without asking first: the ctx's answer to the
router carries the block table, so the request costs no control round trip before its copy. The
ctx may still free those blocks at any time (the hold expired, the client left, the router
released it), and freed blocks are reused by the next prefill. The lease word closes that gap:

- ctx (`LeaseBoard.create`): granting a pull writes the grant's serial (unique, never 0) into
  word ``serial % num_words`` of a file in ``/dev/shm`` mapped into the ctx; the ctx zeroes it
  *before* the request's blocks are handed back to its engine (`KVSender._free`), and zeroes
  every word when it stops.
- gen (`LeaseBoard.attach`, read only): the rank checks the word before launching its copy and
  again after the copy ended. Still the serial then means the ctx had not started freeing the
  blocks when the copy ended, so every byte read was the request's own. Anything else (zeroed,
  or another grant's serial: more grants live than words) and the copy is thrown away and the
  rank asks with RequestShard, the path that needs no lease.

Why a shared-memory word and not a message: the check must cost nanoseconds to keep the
transfer at copy speed, and it must be answered by the ctx's own state, not by a clock (a ctx
that frees early, for any reason, must never leave a gen decoding another request's KV).
Ordering: the ctx's store precedes (program order, then the engine thread's queue hand-off) any
reuse of the blocks; the gen's load follows the copy's completion event. Both processes must see
the same ``/dev/shm`` (one host; containers need ``ipc: host``, which CUDA IPC needs anyway);
where the file cannot be opened the gen never takes the granted path.

Why our own: neither ucxx nor torch offers a cross-process flag word; ``multiprocessing``'s
``SharedMemory`` registers attached segments with a resource tracker that unlinks them when the
*attaching* process exits (Python < 3.13), so a plain mmap'd file is used.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import numpy as np

LEASE_DIR = Path("/dev/shm")
DEFAULT_WORDS = 16384  # 128 KiB; more grants live at once than this only costs the fast path
_NAME = re.compile(r"helixserve-lease-[0-9a-f]{16}")


class LeaseError(RuntimeError):
    """The lease file cannot be made or opened (named cause): grants are not used."""


class LeaseBoard:
    """One ctx worker's lease words (created by the ctx, attached read-only by gen ranks)."""

    def __init__(self, path: Path, words: np.ndarray, buffer: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.words = words
        self._mmap = buffer
        self.owner = owner
        self.num_words = int(words.size)
        self.is_closed = False

    @classmethod
    def create(cls, num_words: int = DEFAULT_WORDS, directory: Path = LEASE_DIR) -> LeaseBoard:
        if num_words < 1:
            raise ValueError(f"num_words must be >= 1, got {num_words}")
        path = directory / f"helixserve-lease-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise LeaseError(f"cannot create the lease file {path}: {error}") from None
        try:
            os.ftruncate(fd, num_words * 8)
            buffer = mmap.mmap(fd, num_words * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as error:
            path.unlink(missing_ok=True)
            raise LeaseError(f"cannot map the lease file {path}: {error}") from None
        finally:
            os.close(fd)
        return cls(path, np.frombuffer(buffer, dtype=np.uint64), buffer, owner=True)

    @classmethod
    def attach(cls, path: str, num_words: int, directory: Path = LEASE_DIR) -> LeaseBoard:
        """Map a ctx's lease file read-only; LeaseError naming why not."""
        name = Path(path).name
        if not _NAME.fullmatch(name) or Path(path).parent != directory or not 1 <= num_words <= 1 << 24:
            raise LeaseError(f"not a lease file: {path!r} ({num_words} words)")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise LeaseError(f"cannot open the ctx's lease file {path}: {error}") from None
        try:
            if os.fstat(fd).st_size != num_words * 8:
                raise LeaseError(f"the lease file {path} is not {num_words} words long")
            buffer = mmap.mmap(fd, num_words * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as error:
            raise LeaseError(f"cannot map the ctx's lease file {path}: {error}") from None
        finally:
            os.close(fd)
        return cls(Path(path), np.frombuffer(buffer, dtype=np.uint64), buffer, owner=False)

    def index(self, serial: int) -> int:
        return serial % self.num_words

    def grant(self, serial: int) -> None:
        """ctx: the blocks of grant `serial` are held from now (its word names it)."""
        if serial < 1:
            raise ValueError(f"a grant serial is >= 1, got {serial}")
        self.words[self.index(serial)] = serial

    def revoke(self, serial: int) -> None:
        """ctx: grant `serial`'s blocks are about to be freed (call before handing them back)."""
        index = self.index(serial)
        if not self.is_closed and int(self.words[index]) == serial:
            self.words[index] = 0

    def holds(self, serial: int) -> bool:
        """gen: the ctx still holds grant `serial` (read now); False once closed."""
        return not self.is_closed and serial >= 1 and int(self.words[self.index(serial)]) == serial

    def close(self) -> None:
        """ctx: revoke every grant, then remove the file. The mapping goes with the last view."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.owner:
            self.words[:] = 0
            self.path.unlink(missing_ok=True)
