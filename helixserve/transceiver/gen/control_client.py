"""A gen rank's side of the control plane: the `KVTransfer` client (see `transceiver.control`).

Every call carries a deadline, so no caller waits on the control plane without bound: RequestShard
the transfer's remaining time, Cancel and Acknowledge `TransceiverConfig.rpc_timeout_ms`. Calls wait
for the channel to connect (`wait_for_ready`, retried with backoff) up to that deadline; a call
whose channel never connected fails as `UNAVAILABLE` naming the peer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent import futures

import grpc

from helixserve.config_transceiver import TransceiverConfig
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol import transfer_pb2_grpc as pb_grpc
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.transceiver.control import target
from helixserve.transceiver.control_auth import call_metadata, channel_credentials, channel_options

logger = logging.getLogger(__name__)


# a ctx worker that restarts on the same endpoint is reachable again within a second; each
# channel has its own subchannels (gRPC shares them, backoff included, across equal channels).
# grpc.min_reconnect_backoff_ms is also the least time one connection attempt gets to finish its
# HTTP/2 handshake: at 100 ms a loaded peer failed it ("connection attempt timed out before
# receiving SETTINGS frame"); calls are bounded by their deadlines, not by this. No client idle
# timeout: a connection closes only when the ctx goes away (receivers read that as its death)
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 20_000),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.use_local_subchannel_pool", 1),
                   ("grpc.client_idle_timeout_ms", 2**31 - 1)]


# internal: RequestShard ends this much before its transfer's deadline (the reply must still
# arrive within the receiver's own deadline); a fraction of any sane kv_transfer_timeout_ms
SHARD_DEADLINE_MARGIN_S = 0.1
ASYNC_CALL_THREADS = 4  # per client: concurrent *_async calls (each bounded by its deadline)
# internal: a closed client's channel is closed this much later, once grpc's connectivity thread
# (it wakes every 0.2 s) has seen the unsubscription and ended: closed under it, it raises
CHANNEL_CLOSE_DELAY_S = 0.5


class ControlUnreachableError(grpc.RpcError):
    """A call whose channel never connected before its deadline (``code()``: ``UNAVAILABLE``)."""

    def __init__(self, target_name: str, timeout_s: float, state: grpc.ChannelConnectivity | None = None) -> None:
        # the channel's last state says which: CONNECTING (an attempt never finished: no answer to
        # the connect or the HTTP/2 handshake) or TRANSIENT_FAILURE (refused, or name not resolved)
        seen = f" (channel {state.name.lower()})" if state is not None else ""
        super().__init__(f"could not connect to {target_name} within {timeout_s:.1f} s{seen}")
        self._details = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class _CallFuture(futures.Future):
    """A `concurrent.futures.Future` for a started grpc call; `cancel()` cancels the call too."""

    def __init__(self, call) -> None:  # noqa: ANN001 (a grpc future)
        super().__init__()
        self._grpc_call = call

    def cancel(self) -> bool:
        self._grpc_call.cancel()
        return super().cancel()


class ControlClient:
    """Calls one ctx worker's service; every call has a deadline (see the module docstring).

    ``request_shard_async`` starts grpc's own call future on the calling thread (see there); the
    other ``*_async`` calls run the blocking call on a small, long-lived thread pool and return a
    ``concurrent.futures.Future`` (``done`` / ``result`` / ``exception`` / ``cancel`` /
    ``add_done_callback``, as gRPC's futures): grpc's own ``.future()`` on a sync channel starts
    a channel spin thread for calls in flight, which costs about a millisecond per call when
    calls come one at a time (one request's RequestShard, then its Acknowledge).
    ``config``: the internal secret every call carries and the TLS settings (None: neither).
    """

    def __init__(self, endpoint: TransceiverEndpoint, timeout_s: float, *,
                 config: TransceiverConfig | None = None, connect_now: bool = False) -> None:
        if not timeout_s > 0:
            raise ValueError(f"control-plane timeout must be > 0 s, got {timeout_s}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        tls = config.control_tls if config is not None else None
        self._metadata = call_metadata(config.secret if config is not None else None)
        if tls is not None:
            self._channel = grpc.secure_channel(target(endpoint), channel_credentials(tls),
                                                options=CHANNEL_OPTIONS + channel_options(tls))
        else:
            self._channel = grpc.insecure_channel(target(endpoint), options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVTransferStub(self._channel)
        self._pool = futures.ThreadPoolExecutor(ASYNC_CALL_THREADS, thread_name_prefix="kv-control-client")
        self.state = grpc.ChannelConnectivity.IDLE
        self._has_connected = False
        self.num_losses = 0  # connections to the ctx that closed under us (see `is_lost_since`)
        # connect_now: resolve and connect at once, not at the first call (`ControlClients.connect_ahead`)
        self.opened_ahead = connect_now
        self._channel.subscribe(self._on_state, try_to_connect=connect_now)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        ready = grpc.ChannelConnectivity.READY
        if self.state is ready and state is not ready:
            self.num_losses += 1
            logger.warning("control connection to ctx worker %s lost (channel %s)", target(self.endpoint),
                           state.name.lower())
        self.state = state
        self._has_connected = self._has_connected or state is ready

    def is_lost_since(self, num_losses: int) -> bool:
        """An established connection to the ctx closed since `num_losses` was read: the ctx
        worker went away (its service never closes a connection while it serves: no idle or age
        limit), so what it was sending will not come."""
        return self.num_losses != num_losses

    @property
    def is_ready(self) -> bool:
        return self.state is grpc.ChannelConnectivity.READY

    @property
    def is_failing(self) -> bool:
        """The channel's last connection attempt failed (calls fail fast until its backoff ends)."""
        return self.state is grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def _deadline(self, timeout_s: float | None) -> float:
        return max(0.001, min(self.timeout_s, timeout_s if timeout_s is not None else self.timeout_s))

    def _call(self, method, request, timeout_s: float):  # noqa: ANN001, ANN202 (a stub method)
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as error:
            raise self._mapped(error, timeout_s) from None

    def _mapped(self, error: grpc.RpcError, timeout_s: float) -> grpc.RpcError:
        is_deadline = getattr(error, "code", None) and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        if is_deadline and not self._has_connected and self.state is not grpc.ChannelConnectivity.READY:
            return ControlUnreachableError(target(self.endpoint), timeout_s, self.state)
        return error

    def _shard_deadline(self, timeout_s: float | None) -> float:
        """RequestShard's: the transfer's remaining time (its connect may use all of it), less a
        margin so that a ctx never reached is reported as unreachable, not as a plain timeout."""
        if timeout_s is None:
            return self.timeout_s
        margin = SHARD_DEADLINE_MARGIN_S if timeout_s > 2 * SHARD_DEADLINE_MARGIN_S else timeout_s / 2
        return max(0.001, timeout_s - margin)

    def request_shard(self, request: pb.ShardRequest, timeout_s: float | None = None) -> pb.ShardReply:
        return self._call(self._stub.RequestShard, request, self._shard_deadline(timeout_s))

    def request_shard_async(self, request: pb.ShardRequest, timeout_s: float | None = None) -> futures.Future:
        """Started on the calling thread (grpc's own call future), so the request is on its way
        when this returns: the receiver then posts its receives while it travels, instead of
        holding the GIL while a pool thread waits to send it (+~1 ms to the ctx's first send on the
        2-core box). Its reply is off the critical path (the data flows meanwhile), so the
        channel spin thread's cost does not show. Errors are mapped as the blocking calls' are."""
        deadline = self._shard_deadline(timeout_s)
        call = self._stub.RequestShard.future(request, timeout=deadline, metadata=self._metadata,
                                              wait_for_ready=True)
        out = _CallFuture(call)

        def settle(done) -> None:  # noqa: ANN001 (a grpc future)
            if not out.set_running_or_notify_cancel():
                return  # cancelled by the caller (the grpc call was cancelled with it)
            try:
                out.set_result(done.result())
            except grpc.RpcError as error:
                out.set_exception(self._mapped(error, deadline))
            except BaseException as error:  # noqa: BLE001 (handed to the caller)
                out.set_exception(error)

        call.add_done_callback(settle)
        return out

    def cancel(self, request: pb.CancelRequest, timeout_s: float | None = None) -> pb.CancelReply:
        return self._call(self._stub.Cancel, request, self._deadline(timeout_s))

    def cancel_async(self, request: pb.CancelRequest, timeout_s: float | None = None) -> futures.Future:
        return self._pool.submit(self._call, self._stub.Cancel, request, self._deadline(timeout_s))

    def acknowledge(self, request: pb.AckRequest, timeout_s: float | None = None) -> pb.AckReply:
        return self._call(self._stub.Acknowledge, request, self._deadline(timeout_s))

    def acknowledge_async(self, request: pb.AckRequest, timeout_s: float | None = None) -> futures.Future:
        return self._pool.submit(self._call, self._stub.Acknowledge, request, self._deadline(timeout_s))

    def describe_pools_async(self, request: pb.PoolsRequest, timeout_s: float | None = None) -> futures.Future:
        return self._pool.submit(self._call, self._stub.DescribePools, request, self._deadline(timeout_s))

    def stop_watching(self) -> None:
        self._channel.unsubscribe(self._on_state)

    def close(self) -> None:
        """Stop watching the channel and close it (after `CHANNEL_CLOSE_DELAY_S`, not blocking)."""
        self.stop_watching()
        self._pool.shutdown(wait=False, cancel_futures=True)  # calls in flight end by their deadline
        closer = threading.Timer(CHANNEL_CLOSE_DELAY_S, self._channel.close)
        closer.daemon = True
        closer.start()


class ControlClients:
    """One client (one channel) per ctx endpoint, shared by a receiver's transfers. A client
    whose channel is failing (the ctx was down) is replaced by a fresh one for new transfers, so
    a restarted ctx worker is not refused for the rest of the old channel's reconnect backoff;
    the old one stays with the transfers that use it.

    `connect_ahead` opens the deployment's channels when the gen rank starts, so that a transfer
    finds its connection up: no name lookup and no handshake on the request's path. (A name
    service that stops answering for a while, as a container network's DNS can while containers
    join it, would otherwise fail the transfer: gRPC cannot connect to a name it cannot resolve.)
    A channel opened ahead is handed to a transfer only once connected; until then a transfer gets
    a fresh one, as without it, never one stuck behind a pending attempt, and the one opened ahead
    stays (connecting) for when the transfers' channel fails; only `close` closes it (grpc's
    connectivity thread fails on a channel collected under it).
    """

    def __init__(self, timeout_s: float, config: TransceiverConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.config = config
        self._clients: dict[str, ControlClient] = {}
        self._ahead: dict[str, ControlClient] = {}  # opened ahead, not yet handed out
        self._lock = threading.Lock()

    def connect_ahead(self, endpoints: Iterable[TransceiverEndpoint]) -> None:
        """Start connecting to each endpoint now (not blocking; gRPC retries until it answers)."""
        with self._lock:
            for endpoint in endpoints:
                key = target(endpoint)
                if key not in self._clients and key not in self._ahead:
                    self._ahead[key] = ControlClient(endpoint, self.timeout_s, config=self.config, connect_now=True)

    def state(self, endpoint: TransceiverEndpoint) -> grpc.ChannelConnectivity | None:
        """The channel state of the endpoint's transfers' client, else of the one opened ahead
        (None: neither)."""
        with self._lock:
            client = self._clients.get(target(endpoint)) or self._ahead.get(target(endpoint))
            return None if client is None else client.state

    def get(self, endpoint: TransceiverEndpoint) -> ControlClient:
        with self._lock:
            key = target(endpoint)
            client = self._clients.get(key)
            if client is not None and client.is_failing:
                client.stop_watching()  # left to its transfers (closed when unreferenced)
                client = None
            if client is None:
                ahead = self._ahead.get(key)
                if ahead is not None and ahead.is_ready:
                    client = self._ahead.pop(key)
                else:
                    client = ControlClient(endpoint, self.timeout_s, config=self.config)
                self._clients[key] = client
            return client

    def close(self) -> None:
        with self._lock:
            for client in (*self._clients.values(), *self._ahead.values()):
                client.close()
            self._clients.clear()
            self._ahead.clear()
