"""Who may use the KV transfer control plane: the deployment's internal secret and optional TLS.

- **Secret**: every client call carries ``x-helixserve-internal-secret`` metadata; the ctx's
  server answers a call only when it carries the configured secret (compared in constant time),
  else ``UNAUTHENTICATED`` before any handler runs. No secret configured: the server answers
  anyone (tests, a dev deployment on a trusted machine) and clients send none.
- **TLS** (``TransceiverConfig.control_tls``): grpc's own credentials; the server presents its
  certificate, clients verify it against the CA file (and present theirs for mutual TLS). Without
  TLS the secret travels in clear text: the control plane must then stay on a private network.
"""

from __future__ import annotations

import hmac
import logging

import grpc

from helixserve.config_transceiver import ControlTLSConfig
from helixserve.log_throttle import ThrottledLog

logger = logging.getLogger(__name__)

SECRET_METADATA = "x-helixserve-internal-secret"


def _deny(_request: bytes, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "this KV transfer service answers only callers holding the deployment's internal secret")


class SecretInterceptor(grpc.ServerInterceptor):
    """Refuses (``UNAUTHENTICATED``) every call without the secret, before its handler runs."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the internal secret must not be empty")
        self._secret = secret.encode()
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)
        self.refusals = ThrottledLog(logger)  # a caller without the secret may call at any rate

    def is_authorized(self, metadata) -> bool:  # noqa: ANN001 (grpc metadata tuple)
        for key, value in metadata or ():
            if key == SECRET_METADATA:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._secret)
        return False

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        if self.is_authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        # one key for every method: the method name is the caller's to choose
        self.refusals.log("unauthenticated", "refused %s: the caller does not hold the internal secret",
                          handler_call_details.method)
        return self._denied


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """What every client call sends (nothing without a secret)."""
    return ((SECRET_METADATA, secret),) if secret else ()


def _read(path) -> bytes:  # noqa: ANN001 (Path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"control-plane TLS: cannot read {path}: {exc.strerror}") from None


def server_credentials(tls: ControlTLSConfig) -> grpc.ServerCredentials:
    pair = [(_read(tls.key_file), _read(tls.cert_file))]
    if tls.require_client_cert:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(tls.ca_file), require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(tls: ControlTLSConfig) -> grpc.ChannelCredentials:
    if tls.require_client_cert:
        return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file), private_key=_read(tls.key_file),
                                            certificate_chain=_read(tls.cert_file))
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file))


def channel_options(tls: ControlTLSConfig | None) -> list[tuple[str, str]]:
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []
