"""CUDA IPC: a ctx worker's device cache pools, opened once by the gen ranks of the same host.

Between processes of one host the fastest path for a shard is a one-sided copy: the receiver maps
the sender's pools into its own address space once and copies each request's bytes device to
device, out of the ctx's blocks straight into its own, with one unit-copy launch
(:func:`helixserve.kernels.copy.units.unit_copy`). No bounce buffer, no UCX message, no
rendezvous round trip: a request costs its RequestShard (which the tagged path pays too) and the
copy, at device-copy speed, when the ctx and this rank share one GPU (between two GPUs the shard
travels as UCX messages, which use cuda_ipc over NVLink: the copy kernel runs on one device).

Why our own and not UCX RMA: ucxx's Python API has tag, stream and active messages but no memory
registration, remote keys or put/get; NIXL has them but is not part of the GPU install. The
handles are torch's own (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, the fields
``torch.multiprocessing`` sends between processes), carried field by field in the control plane's
``PoolsReply`` (never pickled). Across hosts, or where a handle does not open (another host, a
GPU this process cannot see, another GPU than this rank's, containers without ``ipc: host``), the receiver
keeps using the tagged UCX stream.

- ctx (:class:`PoolExport`): ``describe`` answers DescribePools: the pools' storages (one per
  CUDA allocation), each cache tensor as (storage, byte offset, shape, dtype) (a hidden drafter's
  prompt cache too, ``DRAFT_KV`` / ``DRAFT_FEATURES``), the GPU's UUID and an ``epoch`` naming
  this export; ``supported=False`` with the reason when the caches are not on
  a GPU or the caller is on another host.
- gen (:class:`PoolDirectory`): per ctx endpoint, DescribePools once (asynchronously; requests
  use the tagged stream until it answered), then :func:`open_pools` checks the tensors against
  the layout and opens them. A ctx that answers a pull request with the tagged stream (a new
  epoch: it restarted) is forgotten and described again.

Trust: the ctx is a member of the deployment (the control plane is authenticated); its tensor
list is still checked against the layout and its storages' sizes before use.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helixserve.cache_layout import DraftCaches, ModelCaches
from helixserve.dtypes import ITEMSIZE, dtype_name, itemsize, torch_dtype
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import KVLayout
from helixserve.transceiver.lease import LeaseBoard, LeaseError
from helixserve.transceiver.cache_check import caches_device, check_caches

logger = logging.getLogger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_KIND_FIELDS = {pb.IpcTensor.MLA_KV: "mla_kv", pb.IpcTensor.KDA_STATE: "kda_state",
                pb.IpcTensor.CONV_STATE: "conv_state"}


class IpcOpenError(RuntimeError):
    """The ctx's pools cannot be opened here (named cause); the tagged stream is used instead."""


def host_id() -> str:
    """This host's boot id: processes (and containers) of one host share it."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_of(uuid: str) -> int | None:
    """The index of the visible GPU with this UUID, or None."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


class PoolExport:
    """The ctx side: what DescribePools answers (built once, on first call)."""

    def __init__(self, caches: ModelCaches, enabled: bool = True) -> None:
        self.caches = caches
        self.enabled = enabled
        self.epoch = secrets.randbits(63) | 1  # never 0 (0 = "no pull" on the wire)
        self.grant_key = secrets.token_bytes(32)
        self._reply: pb.PoolsReply | None = None
        self._lock = threading.Lock()  # gRPC threads
        self.lease: LeaseBoard | None = None  # granted pulls (see `grant`): only for pools on a GPU
        device = caches_device(caches)
        if enabled and device is not None and device.type == "cuda":
            try:
                self.lease = LeaseBoard.create()
            except LeaseError as error:
                logger.warning("pulls are not granted in answers (RequestShard first): %s", error)

    def close(self) -> None:
        """Revoke every grant (the sender stopped)."""
        if self.lease is not None:
            self.lease.close()

    def names(self, epoch: int) -> bool:
        """`epoch` is this export's and the pools were handed out (a pull may be answered)."""
        return self._reply is not None and epoch == self.epoch

    def describe(self, request: pb.PoolsRequest) -> pb.PoolsReply:
        if not self.enabled:
            return pb.PoolsReply(supported=False, reason="cuda_ipc is off on this ctx worker")
        device = caches_device(self.caches)
        if device is None or device.type != "cuda":
            return pb.PoolsReply(supported=False, reason=f"the ctx's caches are on {device or 'several devices'}")
        if not request.host_id or request.host_id != host_id():
            return pb.PoolsReply(supported=False, reason="the receiver is on another host")
        with self._lock:
            if self._reply is None:
                self._reply = self._export(device)
            return self._reply

    def _export(self, device: torch.device) -> pb.PoolsReply:
        reply = pb.PoolsReply(supported=True, epoch=self.epoch, device_uuid=device_uuid(device))
        if self.lease is not None:
            reply.grant_key, reply.lease_path, reply.lease_words = (
                self.grant_key, str(self.lease.path), self.lease.num_words)
        storages: dict[tuple[bytes, int], int] = {}
        for kind, layer_id, tensor in _exported_tensors(self.caches):
            storage = tensor.untyped_storage()
            (_, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
            key = (bytes(handle), int(offset))
            if key not in storages:
                storages[key] = len(reply.storages)
                reply.storages.append(pb.IpcStorage(
                    handle=handle, size_bytes=size, offset_bytes=offset, ref_counter_handle=ref_handle,
                    ref_counter_offset=ref_offset, event_handle=event_handle or b"",
                    event_sync_required=bool(event_sync)))
            reply.tensors.append(pb.IpcTensor(
                kind=kind, layer_id=layer_id, storage=storages[key],
                byte_offset=tensor.storage_offset() * tensor.element_size(), shape=list(tensor.shape),
                dtype=dtype_name(tensor.dtype)))
        return reply


def _exported_tensors(caches: ModelCaches) -> list[tuple[int, int, torch.Tensor]]:
    """``(IpcTensor kind, layer id, tensor)`` of every pool a ctx exports: the cache's, and a hidden
    drafter's prompt cache where the ctx has one (``caches.draft``)."""
    out = [(kind, layer_id, tensor) for kind, name in _KIND_FIELDS.items()
           for layer_id, tensor in sorted(getattr(caches, name).items())]
    if caches.draft is not None:
        out += [(pb.IpcTensor.DRAFT_KV, layer_id, tensor) for layer_id, tensor in sorted(caches.draft.mla_kv.items())]
        out.append((pb.IpcTensor.DRAFT_FEATURES, 0, caches.draft.features))
    return out


@dataclass(slots=True)
class RemotePools:
    """A ctx's pools opened in this process (views on its memory; read only by convention)."""

    epoch: int
    caches: ModelCaches
    storages: list[torch.UntypedStorage]  # keeps the mappings open
    grant_key: bytes = b""
    lease: LeaseBoard | None = None  # the ctx's lease words: granted pulls are usable
    pairs: dict = field(default_factory=dict)  # pull.PullPair per receiving cache set (go with these pools)


def open_pools(reply: pb.PoolsReply, layout: KVLayout, device: torch.device) -> RemotePools:
    """Open a DescribePools answer for copies onto `device`; IpcOpenError naming the cause."""
    if not reply.supported:
        raise IpcOpenError(reply.reason or "the ctx does not export its pools")
    index = local_device_of(reply.device_uuid)
    if index is None:
        raise IpcOpenError(f"the ctx's GPU {reply.device_uuid} is not visible here")
    if index != device.index:  # the unit copy runs on one device; peer access is never enabled here
        raise IpcOpenError(f"the ctx's pools are on cuda:{index}, this rank's on cuda:{device.index}: the pull "
                           "copies within one GPU, so the shard travels as UCX messages (cuda_ipc between GPUs)")
    try:
        storages = [torch.UntypedStorage._new_shared_cuda(
            index, s.handle, s.size_bytes, s.offset_bytes, s.ref_counter_handle, s.ref_counter_offset,
            s.event_handle or None, s.event_sync_required) for s in reply.storages]
    except Exception as error:  # noqa: BLE001 (any failure: use the tagged stream)
        raise IpcOpenError(f"opening the ctx's CUDA IPC handles failed: {type(error).__name__}: {error}") from None
    flats = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),)) for s in storages]
    caches = ModelCaches(layout.tokens_per_block)
    draft_kv: dict[int, torch.Tensor] = {}
    features = None
    for t in reply.tensors:
        is_draft = t.kind in (pb.IpcTensor.DRAFT_KV, pb.IpcTensor.DRAFT_FEATURES)
        if (t.kind not in _KIND_FIELDS and not is_draft) or t.storage >= len(storages) or t.dtype not in ITEMSIZE:
            raise IpcOpenError(f"malformed pool entry for layer {t.layer_id}")
        size = itemsize(t.dtype)
        nbytes = math.prod(int(dim) for dim in t.shape) * size
        flat = flats[t.storage]
        if t.byte_offset + nbytes > flat.numel() or t.byte_offset % size:
            raise IpcOpenError(f"layer {t.layer_id}'s pool does not fit its {flat.numel()}-byte storage")
        view = flat[t.byte_offset : t.byte_offset + nbytes].view(torch_dtype(t.dtype)).view(tuple(t.shape))
        if t.kind == pb.IpcTensor.DRAFT_FEATURES:
            features = view
        else:
            (draft_kv if is_draft else getattr(caches, _KIND_FIELDS[t.kind]))[int(t.layer_id)] = view
    if draft_kv and features is not None:  # the drafter's prompt cache (pull.PullPair checks its shapes)
        caches.draft = DraftCaches(draft_kv, features, lambda request_id: [])
    try:
        check_caches(layout, caches, _exported_heads(caches, layout))
    except ValueError as error:
        raise IpcOpenError(f"the ctx's pools do not match the layout: {error}") from None
    lease = None
    if reply.lease_path and len(reply.grant_key) >= 16:
        try:
            lease = LeaseBoard.attach(reply.lease_path, reply.lease_words)
        except LeaseError as error:
            logger.info("granted pulls are not used (RequestShard first): %s", error)
    return RemotePools(reply.epoch, caches, storages, bytes(reply.grant_key), lease)


def _exported_heads(caches: ModelCaches, layout: KVLayout) -> int:
    """The KDA heads of an exporting ctx rank's pools: ``H / ctx_tp_size`` of its world, read from
    its state pools (a single ctx worker's: all ``H``); ValueError when no world size gives them."""
    pools = list(caches.kda_state.values())
    if not pools:
        return layout.num_kda_heads
    heads = int(pools[0].shape[1]) if pools[0].dim() == 4 else 0
    if heads < 1 or layout.num_kda_heads % heads:
        raise ValueError(f"a KDA state pool of {heads} heads is no ctx rank's share of {layout.num_kda_heads}")
    return heads


def ask_until_answered(make_client, request: pb.PoolsRequest, retry_s: float, attempts: int) -> Future:  # noqa: ANN001
    """DescribePools through a fresh ``make_client()``, asked again every `retry_s` while the ctx
    does not answer (it may still be loading its model when a gen rank starts), at most
    `attempts` times; the returned future gets the first answer or the last error. Each client is
    closed once its call ended. Runs on gRPC's and timer threads, never blocking the caller."""
    outer: Future = Future()

    def attempt(left: int) -> None:
        client = make_client()
        call = client.describe_pools_async(request)

        def done(call: Future) -> None:
            client.close()
            error = call.exception()
            if error is None:
                outer.set_result(call.result())
            elif left > 1:
                timer = threading.Timer(retry_s, attempt, args=(left - 1,))
                timer.daemon = True
                timer.start()
            else:
                outer.set_exception(error)
        call.add_done_callback(done)

    attempt(max(attempts, 1))
    return outer


class PoolDirectory:
    """The gen side: each ctx worker's opened pools, described once (engine thread only)."""

    def __init__(self, gen_rank: int, layout: KVLayout, enabled: bool = True) -> None:
        self.gen_rank = gen_rank
        self.layout = layout
        self.enabled = enabled
        self._pools: dict[str, RemotePools | None] = {}  # None: that ctx uses the tagged stream
        self._asking: dict[str, Future] = {}

    def ask(self, key: str, client, device: torch.device) -> Future | None:  # noqa: ANN001
        """Start asking ctx `key` for its pools through `client` unless known or asked already;
        the call's future (None: nothing asked, or pools never used from `device`)."""
        if not self.enabled or device.type != "cuda" or key in self._pools or key in self._asking:
            return None
        future = self._asking[key] = client.describe_pools_async(self.request())
        return future

    def request(self) -> pb.PoolsRequest:
        return pb.PoolsRequest(gen_rank=self.gen_rank, host_id=host_id())

    def wants(self, key: str, device: torch.device) -> bool:
        """Ctx `key`'s pools are neither known nor asked for, and would be used from `device`."""
        return self.enabled and device.type == "cuda" and key not in self._pools and key not in self._asking

    def expect(self, key: str, future: Future) -> None:
        """Take `future` as ctx `key`'s DescribePools answer (see `ask_until_answered`)."""
        self._asking[key] = future

    def get(self, key: str, client, device: torch.device) -> RemotePools | None:  # noqa: ANN001
        """The opened pools of ctx `key` if it can be pulled from now; asks once (not blocking)."""
        if not self.enabled or device.type != "cuda":
            return None
        if key in self._pools:
            return self._pools[key]
        future = self._asking.get(key)
        if future is None:
            self.ask(key, client, device)
            return None
        if not future.done():
            return None
        del self._asking[key]
        try:
            reply = future.result()
        except IpcOpenError as error:  # opened off this thread (see `opened`), and it failed
            self._pools[key] = None
            logger.info("gen rank %d: ctx %s's shards travel as UCX messages (%s)", self.gen_rank, key, error)
            return None
        except Exception as error:  # noqa: BLE001 (the ctx is unreachable now: ask again later)
            logger.info("gen rank %d: DescribePools to ctx %s failed (%s)", self.gen_rank, key, error)
            return None
        try:
            self._pools[key] = reply if isinstance(reply, RemotePools) else open_pools(reply, self.layout, device)
            logger.info("gen rank %d: copies shards from ctx %s's pools over CUDA IPC", self.gen_rank, key)
        except IpcOpenError as error:
            self._pools[key] = None
            logger.info("gen rank %d: ctx %s's shards travel as UCX messages (%s)", self.gen_rank, key, error)
        return self._pools[key]

    def opened(self, answer: Future, device: torch.device) -> Future:
        """A future of the pools `answer` (a DescribePools future) describes, opened for `device`
        on the thread that completes it, so that no request waits for the IPC handles to open
        (hundreds of ms for a model's pools); `get` takes either kind of future."""
        out: Future = Future()

        def done(answer: Future) -> None:
            try:
                out.set_result(open_pools(answer.result(), self.layout, device))
            except BaseException as error:  # noqa: BLE001 (an IpcOpenError, or the call's own error)
                out.set_exception(error)
        answer.add_done_callback(done)
        return out

    def forget(self, key: str) -> None:
        """Describe `key` again on its next request (it answered a pull with a tagged stream)."""
        self._pools.pop(key, None)
