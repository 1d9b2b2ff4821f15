"""The ctx worker's side of the control plane: the `KVTransfer` gRPC service (see `transceiver.control`).

A handler that raises answers with an error reply instead of a gRPC failure, so the peer always
gets a named cause. With the deployment's internal secret configured the service answers only
calls carrying it (:mod:`..control_auth`); TLS is optional.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Protocol

import grpc

from helixserve.config_transceiver import TransceiverConfig
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol import transfer_pb2_grpc as pb_grpc
from helixserve.transceiver.control_auth import SecretInterceptor, server_credentials

logger = logging.getLogger(__name__)

# internal: a stopping control server finishes the calls in flight for this long (the process is
# shutting down; every call is bounded by its own deadline anyway)
SERVER_STOP_GRACE_S = 1.0


class TransferHandler(Protocol):
    """What the ctx side implements (`KVSender`); called on gRPC worker threads."""

    def request_shard(self, request: pb.ShardRequest) -> pb.ShardReply: ...
    def cancel_shard(self, request: pb.CancelRequest) -> pb.CancelReply: ...
    def acknowledge(self, request: pb.AckRequest) -> pb.AckReply: ...
    def describe_pools(self, request: pb.PoolsRequest) -> pb.PoolsReply: ...


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, handler: TransferHandler) -> None:
        self.handler = handler

    def RequestShard(self, request, context):  # noqa: N802 (gRPC names)
        # a call whose caller already gave up (deadline passed while this server was stalled, or
        # cancelled) must not start a transfer: nobody would receive it
        remaining = context.time_remaining()  # None: no deadline
        if not context.is_active() or (remaining is not None and remaining <= 0):
            logger.warning("RequestShard %s arrived after its caller gave up; refused", request.ctx_request_id)
            return pb.ShardReply(accepted=False, error="the caller's deadline passed before the ctx served it")
        try:
            reply = self.handler.request_shard(request)
        except Exception as error:
            logger.exception("RequestShard %s failed", request.ctx_request_id)
            return pb.ShardReply(accepted=False, error=f"ctx sender error: {type(error).__name__}: {error}")
        if reply.accepted and not context.is_active():  # the caller left while the shard was planned
            logger.warning("RequestShard %s: caller gone after acceptance; cancelling the shard", request.ctx_request_id)
            self.handler.cancel_shard(pb.CancelRequest(ctx_request_id=request.ctx_request_id, cp_rank=request.cp_rank,
                                                       gen_rank=request.gen_rank, reason="caller gone"))
        return reply

    def Cancel(self, request, context):  # noqa: N802
        try:
            return self.handler.cancel_shard(request)
        except Exception:
            logger.exception("Cancel %s failed", request.ctx_request_id)
            return pb.CancelReply(known=False)

    def Acknowledge(self, request, context):  # noqa: N802
        try:
            return self.handler.acknowledge(request)
        except Exception as error:
            logger.exception("Acknowledge %s failed", request.ctx_request_id)
            return pb.AckReply(known=False, error=f"{type(error).__name__}: {error}")

    def DescribePools(self, request, context):  # noqa: N802
        try:
            return self.handler.describe_pools(request)
        except Exception as error:
            logger.exception("DescribePools for gen rank %d failed", request.gen_rank)
            return pb.PoolsReply(supported=False, reason=f"ctx sender error: {type(error).__name__}: {error}")


class ControlServer:
    """The KVTransfer service of one ctx worker.

    Args:
        handler: answers the three calls (thread-safe: several gRPC threads call it).
        host: interface to bind; port 0 picks a free one (see `port` after `start`).
        config: its `internal_secret` (callers must carry it) and `control_tls`; None: neither.
    """

    def __init__(self, handler: TransferHandler, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 4, *, config: TransceiverConfig | None = None) -> None:
        self.host = host
        self.port = port
        secret = config.secret if config is not None else None
        self.tls = config.control_tls if config is not None else None
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-control"),
                                   interceptors=[SecretInterceptor(secret)] if secret else None,
                                   options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(handler), self._server)

    def start(self) -> int:
        address = f"{self.host}:{self.port}"
        if self.tls is not None:
            self.port = self._server.add_secure_port(address, server_credentials(self.tls))
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind the KV transfer control plane to {self.host}")
        self._server.start()
        return self.port

    def stop(self, grace_s: float = SERVER_STOP_GRACE_S) -> None:
        self._server.stop(grace_s).wait(grace_s + 1.0)
