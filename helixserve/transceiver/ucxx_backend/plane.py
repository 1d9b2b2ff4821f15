"""UCX tag send/recv data plane over ucxx's synchronous core API (`ucxx._lib.libucxx`).

One `UcxxDataPlane` per rank owns a UCX context and worker. Peers connect by worker address
(bytes carried by the control plane). The transceiver uses `connect_worker(address)`: ONE
long-lived endpoint per peer worker, created on first use, shared by every request (requests are
told apart by their tags) and closed only at `close()` or by `close_peer` when the peer is known
gone. `connect(peer, address)` opens an endpoint under a caller-chosen key (tests, benchmarks).

Two ways to post:

- `post_send` / `post_recv`: one buffer split into chunks (`chunk_bytes`), each one tag message
  with tag `(tag << 24) | (sender_rank << 16) | chunk_index`;
- `send_message` / `recv_message`: exactly one message with a caller-built 64-bit tag (the
  transceiver's shard streams use `(tag_base << 20) | message_index`, unique per receiver worker).

Progress: by default the caller's polls drive it (`UcxxHandle.test()` progresses the worker). With
`progress_thread=True`, ucxx's own C++ thread progresses the worker in blocking (epoll) mode, without
the GIL, so transfers move while the owner computes; posting from Python threads is then safe
(ucxx serializes on the worker).

Wakeup (`wakeup_on_completion`, needs the progress thread): every request also gets ucxx's
completion future, and a small notifier thread (`_CompletionNotifier`) blocks in ucxx's request
notifier (bounded waits, no GIL) and sets `wakeup` each time requests complete. A poller waiting
on `wakeup` (the receiver's `TransferPoller`, the KV sender thread) then sees a completion within
microseconds instead of at its next tick; the ticks stay as the bound when nothing completes. It
costs Python work per completion: the transceiver turns it on only with
`TransceiverConfig.wake_on_completion` (off by default, see there for the measurement).

UCX facts measured here (ucxx-cu12 0.52, UCX 1.21, CPU host):

- endpoint error handling excludes the shared-memory transports (they have no peer-failure
  handler) and falls back to tcp, several times slower; peer death is covered by the transceiver's
  deadlines, so error handling is off by default. With it off, shm + cma moves ~5 GB/s.
- Closing an endpoint cancels its posted *receives* (they complete with UCXXCanceledError), also
  when the peer is dead. A rendezvous *send* that the peer never matches can NOT be cancelled
  (neither by closing the endpoint nor by `cancel_inflight_requests`): its buffer stays pinned.
  The transceiver therefore never leaves a posted send unmatched while the receiver lives (the
  receiver drains what was posted before it closes, see `transceiver.gen.receiver`).
- Connecting to the address of a dead process raises (UCXXShmemSegmentError) at once.
- UCX matches the endpoints two workers create to each other's addresses into ONE connection:
  closing either side's endpoint breaks the other's (a later rendezvous on it fails as
  cancelled). With several endpoints between the same two workers (one per request) the pairing
  is arbitrary, so closing one request's endpoint cancelled another request's in-flight receives
  (a CI flake). Hence one endpoint per peer worker, never closed per request.
- Tag receives are matched by the *worker*, whatever endpoint posted them. A receive that will
  never get its message is ended by `retract(wire_tag)`: a 0-byte message with that tag sent to our
  own worker completes it without touching its buffer (ucxx has no per-request cancel, and
  closing the shared endpoint would cancel every request's receives).
- A malformed worker address can abort the process inside UCX: addresses must come from a
  trusted control plane.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from helixserve.config import import_without_env_default
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.plane import DataPlane, TransferHandle
from helixserve.transceiver.ucxx_backend.devices import ucx_net_devices

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
MAX_TAG = (1 << 40) - 1
MAX_WIRE_TAG = (1 << 64) - 1
MAX_CHUNKS = 1 << 16
PROGRESS_EPOLL_TIMEOUT_MS = 1  # internal tick: one progress wait of the UCX worker's epoll
NOTIFIER_STOP_S = 1.0  # internal: closing the plane waits this long for the notifier thread
NOTIFIER_PERIOD_NS = 50_000_000  # the notifier's longest wait: it checks for close at least this often


class UcxxMissingError(ImportError):
    """ucxx is not installed: the UCX transport is an extra (``helixserve[cu12]`` / ``[cu13]``)."""


def import_ucxx() -> Any:
    """``ucxx._lib.libucxx``, lazily (only when this backend is chosen); UcxxMissingError naming
    the extra to install when it is absent. Importing ucxx sets ``UCX_MEMTYPE_CACHE=n`` (a CUDA
    workaround of older UCX releases); without CUDA, UCX 1.21 warns on every start that the
    variable is unused, so there the default is removed again (a value the user set stays). With
    CUDA it stays: the CUDA transports read it."""
    try:
        if torch.cuda.is_available():
            import ucxx._lib.libucxx as ucx_api
            return ucx_api
        return import_without_env_default("ucxx._lib.libucxx", "UCX_MEMTYPE_CACHE", "n")
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "ucxx":
            raise
        raise UcxxMissingError(
            "the UCX KV transport (kv_source: ucx, transceiver.backend: ucxx) needs ucxx, which is not "
            "installed: pip install 'helixserve[cu12]' (CPU or CUDA 12) or 'helixserve[cu13]' (CUDA 13)") from None


def _as_uint8(buffer: Any) -> Any:
    """A flat uint8 view that ucxx's Array accepts (host buffer protocol, or a torch tensor on
    CPU or CUDA). The view aliases the caller's memory: a receive writes in place."""
    if isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise ValueError(f"UCX buffers must be contiguous, got strides {buffer.stride()}")
        flat = buffer.reshape(-1).view(torch.uint8)
        return flat if flat.is_cuda else flat.numpy()
    return np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)


class UcxxHandle(TransferHandle):
    """A chunked send or receive: COMPLETED when every chunk completed, FAILED on any error."""

    def __init__(self, plane: UcxxDataPlane, peer: Hashable, requests: list[Any], buffers: list[Any]) -> None:
        self._plane = plane
        self.peer = peer
        self._requests = requests
        self._buffers = buffers  # keep the chunk views alive while UCX may touch them
        self._state = TransferState.TRANSFERRING
        self.error: str | None = None
        self.is_cancel_requested = False

    def test(self) -> TransferState:
        if self._state.is_terminal:
            return self._state
        self._plane.progress()
        if not all(r.completed for r in self._requests):
            return self._state
        for request in self._requests:
            try:
                request.check_error()
            except Exception as error:  # ucxx raises its own UCXX*Error types
                self.error = f"UCX error with peer {self.peer}: {type(error).__name__}: {error}"
                self._state = TransferState.FAILED
                return self._state
        self._state = TransferState.COMPLETED
        self._buffers = []
        return self._state

    def is_quiesced(self) -> bool:
        return all(r.completed for r in self._requests)

    def cancel(self) -> None:
        self.is_cancel_requested = True


class _CompletionNotifier:
    """Sets `plane.wakeup` whenever requests of the plane's worker complete (see the module
    docstring). ucxx completes each request's Python future through its request notifier; this
    thread waits on it (``wait_request_notifier``, at most NOTIFIER_PERIOD_NS at a time), resolves
    the futures (``run_request_notifier``; they are asyncio futures of this thread's private
    loop, nobody awaits them) and sets the event."""

    def __init__(self, plane: UcxxDataPlane) -> None:
        self._plane = plane
        self._worker = plane._worker
        self._api = plane._api
        self._is_stopping = False
        self.loop = asyncio.new_event_loop()  # never runs: it only owns the futures
        self._thread_state = threading.local()  # .has_loop, per thread (and gone with it)
        self.ensure_loop()
        self._worker.populate_python_futures_pool()
        self._thread = threading.Thread(target=self._run, name="ucxx-notifier", daemon=True)
        self._thread.start()

    def ensure_loop(self) -> None:
        """ucxx creates a request's future on the posting thread when its pool is empty, with
        that thread's asyncio event loop; a thread without one (any but the main thread) would
        get no future and the request would never complete. Give such a thread our loop (a
        thread that has its own loop keeps it)."""
        if getattr(self._thread_state, "has_loop", False):
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            asyncio.set_event_loop(self.loop)
        self._thread_state.has_loop = True

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        states = self._api.PythonRequestNotifierWaitState
        try:
            while not self._is_stopping:
                self._worker.populate_python_futures_pool()
                state = self._worker.wait_request_notifier(period_ns=NOTIFIER_PERIOD_NS)
                if state == states.Shutdown:
                    break
                if state == states.Ready:
                    self._worker.run_request_notifier()
                    self._plane.wakeup.set()
        except Exception:  # the pollers' ticks still bound every wait
            logger.exception("UCX completion notifier stopped; pollers fall back to their ticks")

    def stop(self, timeout_s: float = NOTIFIER_STOP_S) -> None:
        self._is_stopping = True
        self._worker.stop_request_notifier_thread()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._worker.clear_python_futures_pool()
            self.loop.close()


class UcxxDataPlane(DataPlane):
    """UCX data plane of one rank.

    Args:
        rank: this rank's id in chunked transfers (encoded in their tags; 0..255).
        chunk_bytes: largest single UCX message of `post_send` / `post_recv`.
        error_handling: UCX endpoint peer-failure handling (forces tcp on one host).
        progress_thread: let ucxx's C++ thread progress the worker (see the module docstring).
        ucx_options: UCX settings for this context (e.g. {"TLS": "sm,self"}), without "UCX_".
        net_devices: ``NET_DEVICES`` for this context (see :mod:`.devices`: TCP listens on those
            interfaces only); None: UCX's default (every device) unless ``ucx_options`` sets it.
        wakeup: the event completions set (default: a new one), e.g. the owner's poller's.
        wakeup_on_completion: set `wakeup` on completions (needs `progress_thread`; default: with
            the progress thread; the transceiver passes `TransceiverConfig.wake_on_completion`).
    """

    def __init__(
        self,
        rank: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        error_handling: bool = False,
        progress_thread: bool = False,
        ucx_options: dict[str, str] | None = None,
        wakeup: threading.Event | None = None,
        wakeup_on_completion: bool | None = None,
        net_devices: str | None = None,
    ) -> None:
        ucx_api = import_ucxx()
        from ucxx._lib.arr import Array

        if not 0 <= rank < 256 or chunk_bytes <= 0:
            raise ValueError(f"rank must be in [0, 256) and chunk_bytes > 0, got {rank}, {chunk_bytes}")
        self._api, self._array = ucx_api, Array
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.error_handling = error_handling
        self.wakeup = wakeup or threading.Event()
        is_notified = progress_thread if wakeup_on_completion is None else wakeup_on_completion
        if is_notified and not progress_thread:
            raise ValueError("wakeup_on_completion needs progress_thread=True")
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        options = dict(ucx_options or {})
        if net_devices:
            options.setdefault("NET_DEVICES", net_devices)
        self._context = ucx_api.UCXContext(config_dict=options, feature_flags=features)
        self._worker = ucx_api.UCXWorker(self._context, enable_python_future=is_notified)
        self._address = self._worker.address.tobytes()
        self._endpoints: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._retracts: list[UcxxHandle] = []  # 0-byte self-sends, kept alive until they complete
        self.has_progress_thread = progress_thread
        self._notifier: _CompletionNotifier | None = None
        if progress_thread:
            self._worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS)
        if is_notified:
            self._notifier = _CompletionNotifier(self)

    @classmethod
    def for_transceiver(cls, config: Any, wakeup: threading.Event, host: str | None = None,
                        peer_hosts: tuple[str, ...] = ()) -> UcxxDataPlane:
        """A KV sender's or receiver's plane: progress thread, wakeups per ``config``
        (``TransceiverConfig``), network devices of ``config.ucx_net_devices`` for a worker at
        ``host`` (a receiver: at its address on the route to ``peer_hosts``)."""
        return cls(progress_thread=True, wakeup=wakeup, wakeup_on_completion=config.wake_on_completion,
                   net_devices=ucx_net_devices(config.ucx_net_devices, host, peer_hosts))

    @property
    def address(self) -> bytes:
        """This worker's UCX address, to hand to peers through the control plane."""
        return self._address

    def connect(self, peer: Hashable, address: bytes) -> None:
        """Open an endpoint to the worker at `address`, named `peer` here (replaces none)."""
        if peer in self._endpoints:
            raise ValueError(f"rank {self.rank}: an endpoint named {peer!r} is already open")
        address_obj = self._api.UCXAddress.create_from_buffer(address)
        with self._lock:
            self._endpoints[peer] = self._api.UCXEndpoint.create_from_worker_address(
                self._worker, address_obj, endpoint_error_handling=self.error_handling
            )

    def connect_worker(self, address: bytes) -> Hashable:
        """The shared endpoint to the worker at `address` (opened on first use); returns its key."""
        peer = ("worker", bytes(address))
        if peer not in self._endpoints:
            self.connect(peer, peer[1])
        return peer

    def retract(self, wire_tag: int) -> UcxxHandle:
        """End this worker's posted receive of `wire_tag` with a 0-byte message to ourselves (the
        receive's buffer is not written). Only for a tag whose real message will not arrive, or
        whose late arrival a second receive (a sink) absorbs: UCX matches in posting order."""
        self._retracts = [h for h in self._retracts if not h.test().is_terminal]
        handle = self.send_message(self.connect_worker(self.address), wire_tag, np.empty(0, dtype=np.uint8))
        self._retracts.append(handle)
        return handle

    def is_connected(self, peer: Hashable) -> bool:
        return peer in self._endpoints

    def close_peer(self, peer: Hashable) -> None:
        """Close the endpoint to `peer`: cancels its posted receives, and breaks the peer's endpoint
        to us. Only when the peer is known gone (or at `close()`), never per request."""
        endpoint = self._endpoints.pop(peer, None)
        if endpoint is not None:
            if self._notifier is not None:
                self._notifier.ensure_loop()
            with self._lock:
                endpoint.close()
            self.progress()

    def progress(self) -> None:
        if self.has_progress_thread:
            return
        with self._lock:
            self._worker.progress()

    def post_send(self, peer: Hashable, tag: int, buffer: Any) -> UcxxHandle:
        return self._post(peer, tag, buffer, is_send=True)

    def post_recv(self, peer: Hashable, tag: int, buffer: Any) -> UcxxHandle:
        return self._post(peer, tag, buffer, is_send=False)

    def send_message(self, peer: Hashable, wire_tag: int, buffer: Any) -> UcxxHandle:
        """Send `buffer` as exactly one message with tag `wire_tag` (no chunking)."""
        return self._post_one(peer, wire_tag, buffer, is_send=True)

    def recv_message(self, peer: Hashable | None, wire_tag: int, buffer: Any) -> UcxxHandle:
        """Receive exactly one message with tag `wire_tag` into `buffer` (sizes must match).
        `peer` None: posted on the worker (UCX matches tags per worker, whoever sends), so it can
        be posted before the sender's address is known; closing an endpoint does not end it."""
        return self._post_one(peer, wire_tag, buffer, is_send=False)

    def _endpoint(self, peer: Hashable) -> Any:
        endpoint = self._endpoints.get(peer)
        if endpoint is None:
            raise ValueError(f"rank {self.rank}: no UCX endpoint to peer {peer!r}; connect() first")
        return endpoint

    def _post_one(self, peer: Hashable | None, wire_tag: int, buffer: Any, is_send: bool) -> UcxxHandle:
        endpoint = self._worker if peer is None and not is_send else self._endpoint(peer)
        if self._notifier is not None:
            self._notifier.ensure_loop()
        if not 0 <= wire_tag <= MAX_WIRE_TAG:
            raise ValueError(f"wire tag must be in [0, 2**64), got {wire_tag}")
        flat = _as_uint8(buffer)
        array = self._array(flat)
        post = endpoint.tag_send if is_send else endpoint.tag_recv
        with self._lock:
            request = post(array, tag=self._api.UCXXTag(wire_tag))
        return UcxxHandle(self, peer, [request], [(flat, array)])

    def _post(self, peer: Hashable, tag: int, buffer: Any, is_send: bool) -> UcxxHandle:
        endpoint = self._endpoint(peer)
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag must be in [0, 2**40), got {tag}")
        flat = _as_uint8(buffer)
        nbytes = int(flat.nbytes)
        num_chunks = max(1, -(-nbytes // self.chunk_bytes))
        if num_chunks > MAX_CHUNKS:
            raise ValueError(f"{nbytes} bytes need {num_chunks} chunks > {MAX_CHUNKS}; raise chunk_bytes")
        if not isinstance(peer, int) or not 0 <= peer < 256:
            raise ValueError(f"chunked transfers name peers by rank in [0, 256), got {peer!r}")
        sender = self.rank if is_send else peer
        if self._notifier is not None:
            self._notifier.ensure_loop()
        requests, chunks = [], []
        for index in range(num_chunks):
            chunk = flat[index * self.chunk_bytes : (index + 1) * self.chunk_bytes]
            wire_tag = self._api.UCXXTag((tag << 24) | (sender << 16) | index)
            array = self._array(chunk)
            post = endpoint.tag_send if is_send else endpoint.tag_recv
            with self._lock:
                requests.append(post(array, tag=wire_tag))
            chunks.append((chunk, array))
        return UcxxHandle(self, peer, requests, chunks)

    def close(self) -> None:
        for peer in list(self._endpoints):
            self.close_peer(peer)
        with self._lock:  # receives posted on the worker (peer None) end here
            self._worker.cancel_inflight_requests()
        if self._notifier is not None:
            self._notifier.stop()
            self._notifier = None
        if self.has_progress_thread:
            self.has_progress_thread = False
            self._worker.stop_progress_thread()
