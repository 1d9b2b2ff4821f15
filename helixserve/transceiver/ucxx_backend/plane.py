"""UCX tag send/recv data plane over ucxx's synchronous core API (`ucxx._lib.libucxx`).

One `UcxxDataPlane` per rank owns a UCX context and worker. Peers connect by worker address
(bytes carried by the control plane): `connect(peer, address)`. A send or receive of one buffer
is split into chunks (`chunk_bytes`) so one huge request cannot monopolize the link; each chunk is
one tag message with tag `(tag << 24) | (sender_rank << 16) | chunk_index`, so messages of
different senders, requests and chunks never match each other.

Progress is driven by the caller's polls (`UcxxHandle.test()` progresses the worker), so there
is no background thread and every wait stays bounded by the transceiver's deadlines.

UCX facts measured here (ucxx-cu12 0.52, UCX 1.21, CPU host): endpoint error handling excludes
the shared-memory transports (they have no peer-failure handler) and falls back to tcp, several
times slower; peer death is covered by the transceiver's deadlines anyway, so error handling is
off by default. UCX has no per-request cancel in ucxx: `cancel()` marks the handle and the
buffer stays quarantined until the operation ends or `close_peer()` closes the endpoint (which
cancels every operation on it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from helixserve.transceiver.base import DataPlane, TransferHandle, TransferState

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
MAX_TAG = (1 << 40) - 1
MAX_CHUNKS = 1 << 16


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

    def __init__(self, plane: UcxxDataPlane, peer: int, requests: list[Any], buffers: list[Any]) -> None:
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
                self.error = f"UCX error with peer rank {self.peer}: {type(error).__name__}: {error}"
                self._state = TransferState.FAILED
                return self._state
        self._state = TransferState.COMPLETED
        self._buffers = []
        return self._state

    def is_quiesced(self) -> bool:
        return all(r.completed for r in self._requests)

    def cancel(self) -> None:
        self.is_cancel_requested = True


class UcxxDataPlane(DataPlane):
    """UCX data plane of one rank.

    Args:
        rank: this rank's id in the transfer (encoded in message tags; 0..255).
        chunk_bytes: largest single UCX message.
        error_handling: UCX endpoint peer-failure handling (forces tcp on one host).
    """

    def __init__(self, rank: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, error_handling: bool = False) -> None:
        import ucxx._lib.libucxx as ucx_api  # lazy: only when this backend is chosen
        from ucxx._lib.arr import Array

        if not 0 <= rank < 256 or chunk_bytes <= 0:
            raise ValueError(f"rank must be in [0, 256) and chunk_bytes > 0, got {rank}, {chunk_bytes}")
        self._api, self._array = ucx_api, Array
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.error_handling = error_handling
        self.wakeup = threading.Event()
        self._context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
        self._worker = ucx_api.UCXWorker(self._context)
        self._endpoints: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> bytes:
        """This worker's UCX address, to hand to peers through the control plane."""
        return self._worker.address.tobytes()

    def connect(self, peer: int, address: bytes) -> None:
        address_obj = self._api.UCXAddress.create_from_buffer(address)
        self._endpoints[peer] = self._api.UCXEndpoint.create_from_worker_address(
            self._worker, address_obj, endpoint_error_handling=self.error_handling
        )

    def close_peer(self, peer: int) -> None:
        """Close the endpoint to `peer`: cancels (and so quiesces) every operation on it."""
        endpoint = self._endpoints.pop(peer, None)
        if endpoint is not None:
            endpoint.close()
            self.progress()

    def progress(self) -> None:
        with self._lock:
            self._worker.progress()

    def post_send(self, peer: int, tag: int, buffer: Any) -> UcxxHandle:
        return self._post(peer, tag, buffer, is_send=True)

    def post_recv(self, peer: int, tag: int, buffer: Any) -> UcxxHandle:
        return self._post(peer, tag, buffer, is_send=False)

    def _post(self, peer: int, tag: int, buffer: Any, is_send: bool) -> UcxxHandle:
        endpoint = self._endpoints.get(peer)
        if endpoint is None:
            raise ValueError(f"rank {self.rank}: no UCX endpoint to peer rank {peer}; connect() first")
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag must be in [0, 2**40), got {tag}")
        flat = _as_uint8(buffer)
        nbytes = int(flat.nbytes)
        num_chunks = max(1, -(-nbytes // self.chunk_bytes))
        if num_chunks > MAX_CHUNKS:
            raise ValueError(f"{nbytes} bytes need {num_chunks} chunks > {MAX_CHUNKS}; raise chunk_bytes")
        sender = self.rank if is_send else peer
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
