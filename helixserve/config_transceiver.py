"""Transceiver configuration: backend choice, transfer deadline, poll interval, bounce pool.

`kv_transfer_timeout_ms` is required and must be finite and positive: a transfer without a
deadline can hang a request (and pin its cache) forever, so configuration refuses it.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

MIB = 1 << 20
DEFAULT_KV_TRANSFER_TIMEOUT_MS = 10_000.0  # a deployment's transfer deadline when its YAML sets none


class TransceiverBackendKind(str, enum.Enum):
    """Which data plane moves the bytes. `fake` is in-process, for fault-injection tests only."""

    UCXX = "ucxx"
    FAKE = "fake"


class ControlTLSConfig(BaseModel):
    """TLS for the gRPC control plane, with grpc's own credentials (PEM files).

    The ctx worker's server presents ``cert_file`` / ``key_file``; gen ranks verify it against
    ``ca_file`` (a self-signed certificate may be its own CA). ``server_name``: the name the
    certificate was issued for when it is not the host gen dials (``ctx.transceiver_host``).
    ``require_client_cert``: the server also asks gen ranks for a certificate signed by
    ``ca_file``, and they present ``cert_file`` / ``key_file`` (mutual TLS, one key pair).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: Path
    key_file: Path
    ca_file: Path
    server_name: str | None = None
    require_client_cert: bool = False


class TransceiverConfig(BaseModel):
    """Validated transceiver settings (one per ctx or gen worker).

    Attributes:
        backend: data plane; `ucxx` in deployments, `fake` in tests.
        kv_transfer_timeout_ms: overall deadline of one request's transfer on one rank,
            anchored at its first send / first receive request. Required, finite, > 0.
        kv_transfer_poll_interval_ms: budget of one executor-step poll (`poll(wait_num, interval)`).
        bounce_size_bytes: requested bounce pool size; rounded up to whole chunks and clamped to a
            share of free memory (see `bounce.bounce_pool_bytes`). 0, None or negative = off
            (direct block writes).
        chunk_bytes: transfer chunk and bounce-pool sizing unit.
        slice_ms: longest single blocking wait inside a deadline (a wait never exceeds the
            remaining time either).
        message_bytes: largest UCX message of a shard stream; a request's payload is cut into
            messages of at most this size, so one huge request cannot monopolize the link.
        pack_bytes: a receiver's pack limit: segments of a shard stream (one layer's blocks or state)
            smaller than this are packed into shared messages (staged: copied on each side), larger
            ones travel in messages of their own, in place where their memory is one run. None:
            every segment packed where the receiver's cache is on a GPU (the message count then
            follows the bytes, not the layers), 1 MiB on the host (where a staging copy costs about
            what the transfer does). The receiver asks with it; the ctx cuts with the asked value.
        send_window_bytes: bytes a sender keeps in flight per receiver stream (at least one
            message; round-robin over streams): bounds what one request holds of the link.
        rpc_timeout_ms: deadline of every control-plane (gRPC) call.
        drain_timeout_ms: how long a receiver that gives up waits for the messages the sender had
            already posted (a UCX rendezvous send cannot be cancelled) before closing regardless.
        wake_on_completion: the UCX plane wakes the receiver's poller and the KV sender thread on
            every completed message (ucxx completion futures + a notifier thread) instead of
            leaving them to their ~1 ms / 0.5 ms ticks. Off by default: on the 2-core CPU box
            the per-completion Python work cost more than the tick latency it saves
            (bench/transceiver.py: 16k-token request 4.4-5.6 GB/s without, 3.4-4.3 GB/s with).
        ucx_net_devices: ``UCX_NET_DEVICES`` of the data plane, e.g. ``"eth0,mlx5_0:1"``; UCX's
            TCP transport listens on those interfaces only. None: the worker's own interface (ctx:
            the one holding ``transceiver_host``; gen: the one routing to the ctx transceivers)
            plus every RDMA port; ``"all"``: every device (UCX's default, listens everywhere).
        cuda_ipc: gen ranks copy shards straight out of the ctx's device pools where both sides'
            caches are on GPUs of one host (CUDA IPC handles exchanged once per ctx worker, one
            unit-copy launch per request, no UCX messages; see `cuda_ipc`). Elsewhere, or off,
            shards travel as UCX tagged messages (cuda_ipc / RDMA / tcp as UCX picks).
        control_tls: TLS for the control plane (None: plaintext gRPC on a private network).
        internal_secret: the deployment's internal secret; every control-plane call carries it
            and the ctx's service answers only calls that do (None: the service answers anyone).
            Never in the YAML: ``helixserve.config.resolve_security`` fills it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: TransceiverBackendKind = TransceiverBackendKind.UCXX
    kv_transfer_timeout_ms: float = Field(
        ..., description="overall per-request transfer deadline in ms; required, finite, > 0"
    )
    kv_transfer_poll_interval_ms: float = 1.0
    bounce_size_bytes: int | None = None
    chunk_bytes: int = 32 * MIB
    slice_ms: float = Field(50.0, description="longest single blocking wait inside a deadline, ms")
    message_bytes: int = 16 * MIB
    pack_bytes: int | None = Field(None, ge=1)
    send_window_bytes: int = 64 * MIB
    rpc_timeout_ms: float = 5000.0
    drain_timeout_ms: float = 2000.0
    wake_on_completion: bool = False
    ucx_net_devices: str | None = None
    cuda_ipc: bool = True
    control_tls: ControlTLSConfig | None = None
    internal_secret: SecretStr | None = Field(None, exclude=True, repr=False)

    @field_validator("kv_transfer_timeout_ms", mode="before")
    @classmethod
    def _finite_timeout(cls, value: object) -> float:
        if value is None:
            raise ValueError(
                "kv_transfer_timeout_ms must be set to a finite number of milliseconds > 0 "
                "(got None): an unbounded transfer can hang a request forever"
            )
        timeout = float(value)  # type: ignore[arg-type]
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"kv_transfer_timeout_ms must be finite and > 0, got {value!r}: "
                "an unbounded transfer can hang a request forever"
            )
        return timeout

    @field_validator("rpc_timeout_ms", "drain_timeout_ms")
    @classmethod
    def _finite_rpc(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"control-plane timeouts must be finite and > 0 ms, got {value!r}")
        return value

    @field_validator("message_bytes", "send_window_bytes")
    @classmethod
    def _positive_int(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"message_bytes and send_window_bytes must be > 0, got {value}")
        return value

    @field_validator("kv_transfer_poll_interval_ms", "slice_ms")
    @classmethod
    def _finite_positive(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"poll interval / slice must be finite and >= 0 ms, got {value!r}")
        return value

    @field_validator("bounce_size_bytes")
    @classmethod
    def _bounce_off(cls, value: int | None) -> int | None:
        # 0, None and negative sizes all mean "bouncing off"; normalize to None.
        return None if value is None or value <= 0 else value

    @field_validator("chunk_bytes")
    @classmethod
    def _positive_chunk(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {value}")
        return value

    @property
    def secret(self) -> str | None:
        return self.internal_secret.get_secret_value() if self.internal_secret is not None else None

    @property
    def timeout_s(self) -> float:
        return self.kv_transfer_timeout_ms / 1000.0

    @property
    def poll_interval_s(self) -> float:
        return self.kv_transfer_poll_interval_ms / 1000.0

    @property
    def rpc_timeout_s(self) -> float:
        return self.rpc_timeout_ms / 1000.0

    @property
    def drain_timeout_s(self) -> float:
        return self.drain_timeout_ms / 1000.0

    @property
    def slice_s(self) -> float:
        return self.slice_ms / 1000.0

    @property
    def is_bounce_enabled(self) -> bool:
        return self.bounce_size_bytes is not None
