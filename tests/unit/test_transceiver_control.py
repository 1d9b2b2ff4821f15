"""Control plane: generated stubs are current, every call has a deadline, a connect is retried up
to it (a slow or late peer is reached), handler errors come back as named replies, a sender's
message list is checked against ours, only callers holding the internal secret are answered, and
TLS (one-way and mutual) works with a self-signed certificate."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import threading
import time

import grpc
import pytest

from helixserve.config_transceiver import ControlTLSConfig, TransceiverConfig
from helixserve.log_throttle import ThrottledLog
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.testing.servers import free_ports
from helixserve.transceiver.control import GENERATED, PROTO, generate_stubs
from helixserve.transceiver.gen.control_client import ControlClient, ControlClients
from helixserve.transceiver.ctx.control_server import ControlServer
from helixserve.transceiver.payloads import check_payloads


def test_generated_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    for path in generate_stubs(tmp_path):
        committed = PROTO.parent / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed} is stale: run python -m helixserve.transceiver.control --regenerate")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(GENERATED)


class _Handler:
    def __init__(self) -> None:
        self.release = threading.Event()

    def request_shard(self, request):
        if request.ctx_request_id == "boom":
            raise RuntimeError("kaput")
        self.release.wait(5.0)  # a stuck ctx
        return pb.ShardReply(accepted=True)

    def cancel_shard(self, request):
        return pb.CancelReply(known=True, num_posted_messages=3)

    def acknowledge(self, request):
        return pb.AckReply(known=True)


@pytest.fixture
def server():
    handler = _Handler()
    srv = handler.server = ControlServer(handler, "127.0.0.1", 0)
    port = srv.start()
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=port), timeout_s=0.3)
    yield handler, client
    handler.release.set()
    client.close()
    srv.stop(0.1)


def test_every_call_has_a_deadline(server):
    handler, client = server
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        client.request_shard(pb.ShardRequest(ctx_request_id="r"))  # the client's 0.3 s
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 1.5
    start = time.monotonic()  # a transfer's RequestShard: its remaining time, not capped at 0.3 s
    with pytest.raises(grpc.RpcError) as error:
        client.request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=0.8)
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.65 < time.monotonic() - start < 2.5  # (less a 0.1 s margin)
    future = client.request_shard_async(pb.ShardRequest(ctx_request_id="r"), timeout_s=0.1)
    assert future.exception(timeout=2.0).code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.cancel(pb.CancelRequest(ctx_request_id="r")).num_posted_messages == 3
    assert client.acknowledge_async(pb.AckRequest(ctx_request_id="r")).result(timeout=2.0).known


def test_a_failing_handler_answers_with_a_named_error(server):
    _, client = server
    reply = client.request_shard(pb.ShardRequest(ctx_request_id="boom"))
    assert not reply.accepted and "RuntimeError: kaput" in reply.error


def test_unreachable_server_is_retried_until_the_deadline_then_unavailable():
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=1), timeout_s=0.6)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        client.cancel(pb.CancelRequest(ctx_request_id="r"))
    assert time.monotonic() - start >= 0.55  # kept trying for the whole deadline
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "could not connect to 127.0.0.1:1 within 0.6 s" in error.value.details()
    # and how: a refused port leaves the channel failing (connecting only between two attempts)
    assert re.search(r"within 0\.6 s \(channel (transient_failure|connecting)\)$", error.value.details())
    client.close()


def test_request_shard_async_starts_at_once_maps_unreachable_and_cancels_its_call():
    """RequestShard runs as grpc's own call future (started on the calling thread): a never
    reached ctx still fails as UNAVAILABLE by name, and cancelling the future cancels the call."""
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=1), timeout_s=5.0)
    start = time.monotonic()
    future = client.request_shard_async(pb.ShardRequest(ctx_request_id="r"), timeout_s=0.7)  # 0.6 s less margin
    error = future.exception(timeout=5.0)
    assert time.monotonic() - start >= 0.55
    assert error.code() is grpc.StatusCode.UNAVAILABLE and "could not connect to 127.0.0.1:1" in error.details()
    pending = client.request_shard_async(pb.ShardRequest(ctx_request_id="r"), timeout_s=5.0)
    assert pending.cancel() and pending.cancelled()
    assert pending._grpc_call.cancelled()  # noqa: SLF001 (the call itself stopped)
    client.close()


def _descriptor(kind, first, sizes):
    return pb.PayloadDescriptor(kind=kind, first_message=first, message_nbytes=sizes)


def test_a_sender_plan_that_differs_from_ours_is_rejected():
    ours = [_descriptor(pb.PayloadDescriptor.AUX, 0, [512]), _descriptor(pb.PayloadDescriptor.KV_BLOCKS, 1, [640, 640])]
    check_payloads(ours, list(reversed(ours)))
    cases = [
        ([ours[0], _descriptor(pb.PayloadDescriptor.KV_BLOCKS, 1, [640, 704])], "kv_blocks differs"),
        ([ours[0]], "kv_blocks differs from ours: missing"),
        ([*ours, ours[0]], "lists payload PayloadKind.AUX twice"),
        ([*ours, _descriptor(pb.PayloadDescriptor.KDA_STATE, 3, [8])], "kda_state differs"),
        ([ours[0], _descriptor(pb.PayloadDescriptor.KV_BLOCKS, 2, [640, 640])], "first message 2"),
    ]
    for theirs, cause in cases:
        with pytest.raises(ValueError, match=cause):
            check_payloads(ours, theirs)


def test_a_server_that_comes_up_within_the_deadline_is_reached():
    """A transfer's RequestShard may use its whole budget to connect (the ctx still starting)."""
    (port,) = free_ports(1)
    handler = _Handler()
    handler.release.set()
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=port), timeout_s=0.2)
    future = client.request_shard_async(pb.ShardRequest(ctx_request_id="r"), timeout_s=10.0)
    time.sleep(0.5)  # refused connections meanwhile
    srv = ControlServer(handler, "127.0.0.1", port)
    srv.start()
    try:
        assert future.result(timeout=12.0).accepted
    finally:
        client.close()
        srv.stop(0.1)


class _SlowProxy:
    """Forwards one TCP port to another, holding each new connection ``delay_s`` first (a loaded
    peer that is slow to send its HTTP/2 SETTINGS frame)."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.upstream_port, self.delay_s = upstream_port, delay_s
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        time.sleep(self.delay_s)
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self.sock.close()


def test_a_slow_handshake_within_the_deadline_is_not_a_failure(server):
    """CI flake 'connection attempt timed out before receiving SETTINGS frame': a connect whose
    handshake takes 400 ms (a loaded ctx) must still succeed inside a 3 s deadline."""
    handler, direct = server
    handler.release.set()
    proxy = _SlowProxy(direct.endpoint.port, delay_s=0.4)
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=proxy.port), timeout_s=3.0)
    try:
        assert client.cancel(pb.CancelRequest(ctx_request_id="r")).num_posted_messages == 3
        assert client.request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=3.0).accepted
    finally:
        client.close()
        proxy.close()


class _CountingHandler(_Handler):
    def __init__(self) -> None:
        super().__init__()
        self.release.set()
        self.num_calls = 0

    def request_shard(self, request):
        self.num_calls += 1
        return super().request_shard(request)

    def cancel_shard(self, request):
        self.num_calls += 1
        return super().cancel_shard(request)

    def acknowledge(self, request):
        self.num_calls += 1
        return super().acknowledge(request)


def _tx(**overrides) -> TransceiverConfig:
    return TransceiverConfig(kv_transfer_timeout_ms=5000, **overrides)


def _calls(client: ControlClient) -> list:
    return [lambda: client.request_shard(pb.ShardRequest(ctx_request_id="r")),
            lambda: client.cancel(pb.CancelRequest(ctx_request_id="r")),
            lambda: client.acknowledge(pb.AckRequest(ctx_request_id="r"))]


def test_the_service_answers_only_callers_holding_the_secret():
    handler = _CountingHandler()
    srv = ControlServer(handler, "127.0.0.1", 0, config=_tx(internal_secret="s3cret"))
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=srv.start())
    strangers = [ControlClient(endpoint, 2.0), ControlClient(endpoint, 2.0, config=_tx(internal_secret="guess")),
                 ControlClient(endpoint, 2.0, config=_tx(internal_secret="s3cret-but-longer"))]
    insider = ControlClient(endpoint, 2.0, config=_tx(internal_secret="s3cret"))
    try:
        for stranger in strangers:
            for call in _calls(stranger):
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "internal secret" in error.value.details()
        assert handler.num_calls == 0  # refused before any handler ran
        assert [bool(call()) for call in _calls(insider)] == [True, True, True]
        assert handler.num_calls == 3
    finally:
        for client in (*strangers, insider):
            client.close()
        srv.stop(0.1)


def test_refused_callers_log_one_throttled_warning_not_one_per_call(caplog):
    """A stranger calling in a loop (300 refused calls) leaves one WARNING line in the log, not
    300; every refusal is still counted."""
    srv = ControlServer(_CountingHandler(), "127.0.0.1", 0, config=_tx(internal_secret="s3cret"))
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=srv.start())
    stranger = ControlClient(endpoint, 2.0)
    caplog.set_level(logging.WARNING, logger="helixserve.transceiver.control_auth")
    try:
        for _ in range(100):
            for call in _calls(stranger):
                with pytest.raises(grpc.RpcError):
                    call()
    finally:
        stranger.close()
        srv.stop(0.1)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, len(refusals)
    assert "does not hold the internal secret" in refusals[0].getMessage()


def test_a_throttled_warning_repeats_after_its_interval_with_the_count_it_held_back(caplog):
    clock = [0.0]
    log = ThrottledLog(logging.getLogger("throttle-test"), interval_s=10.0, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="throttle-test"):
        for _ in range(5):
            log.log("k", "refused %s", "x")
        clock[0] = 9.99
        log.log("k", "refused %s", "x")
        clock[0] = 10.0
        log.log("k", "refused %s", "x")
    assert [r.getMessage() for r in caplog.records] == ["refused x", "refused x (and 5 more in the last 10 s)"]
    assert log.counts == {"k": 7}


def _self_signed(tmp_path, name: str) -> tuple:
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=IP:127.0.0.1,DNS:{name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("is_mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_control_plane_with_a_self_signed_certificate(tmp_path, is_mutual):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificate")
    cert, key = _self_signed(tmp_path, "ctx-control")
    tls = ControlTLSConfig(cert_file=cert, key_file=key, ca_file=cert, require_client_cert=is_mutual)
    handler = _CountingHandler()
    srv = ControlServer(handler, "127.0.0.1", 0, config=_tx(internal_secret="s3cret", control_tls=tls))
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=srv.start())
    other_cert, other_key = _self_signed(tmp_path, "stranger")
    clients = {
        "ok": ControlClient(endpoint, 2.0, config=_tx(internal_secret="s3cret", control_tls=tls)),
        "by-name": ControlClient(endpoint, 2.0, config=_tx(internal_secret="s3cret", control_tls=tls.model_copy(
            update={"server_name": "ctx-control"}))),
        "plaintext": ControlClient(endpoint, 1.0, config=_tx(internal_secret="s3cret")),
        "no-secret": ControlClient(endpoint, 2.0, config=_tx(control_tls=tls)),
        "other-ca": ControlClient(endpoint, 1.0, config=_tx(internal_secret="s3cret", control_tls=ControlTLSConfig(
            cert_file=other_cert, key_file=other_key, ca_file=other_cert, require_client_cert=is_mutual))),
    }
    try:
        assert all(bool(call()) for name in ("ok", "by-name") for call in _calls(clients[name]))
        for name, code in (("plaintext", grpc.StatusCode.UNAVAILABLE), ("other-ca", grpc.StatusCode.UNAVAILABLE),
                           ("no-secret", grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as error:
                clients[name].cancel(pb.CancelRequest(ctx_request_id="r"))
            assert error.value.code() is code, name
        assert handler.num_calls == 6
    finally:
        for client in clients.values():
            client.close()
        srv.stop(0.1)


def test_a_closed_connection_is_seen_as_the_ctx_gone(server):
    """A connection that was up and closed (the ctx's process ended) is counted at once; one
    that stays up, idle, is not."""
    handler, client = server
    assert client.acknowledge(pb.AckRequest(ctx_request_id="r")).known
    seen = client.num_losses
    time.sleep(0.3)  # idle: the connection stays up
    assert not client.is_lost_since(seen) and client.state is grpc.ChannelConnectivity.READY
    handler.server.stop(0)
    deadline = time.monotonic() + 2.0
    while not client.is_lost_since(seen) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.is_lost_since(seen) and client.num_losses == seen + 1


class _OneConnectionProxy(_SlowProxy):
    """Forwards the first TCP connection to ``upstream_port``, then stops listening: every later
    connection is refused (a peer whose name or address stopped answering after that one)."""

    def __init__(self, upstream_port: int) -> None:
        self.accepted = threading.Event()
        super().__init__(upstream_port, delay_s=0.0)

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.sock.close()
        self.accepted.set()
        self._serve(conn)


def _wait_state(clients: ControlClients, endpoint: TransceiverEndpoint, state: grpc.ChannelConnectivity) -> None:
    deadline = time.monotonic() + 5.0
    while clients.state(endpoint) is not state and time.monotonic() < deadline:
        time.sleep(0.01)
    assert clients.state(endpoint) is state


def test_a_channel_connected_ahead_serves_the_first_transfer_when_new_connections_fail(server):
    """`connect_ahead` connects before any call, so the first RequestShard needs no new
    connection (no name lookup, no handshake): it succeeds where a fresh channel cannot connect."""
    handler, _ = server
    handler.release.set()
    proxy = _OneConnectionProxy(handler.server.port)
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=proxy.port)
    ahead, fresh = ControlClients(timeout_s=0.5), ControlClients(timeout_s=0.5)
    try:
        ahead.connect_ahead([endpoint])
        assert proxy.accepted.wait(5.0), "connect_ahead opened no connection"
        _wait_state(ahead, endpoint, grpc.ChannelConnectivity.READY)
        client = ahead.get(endpoint)
        assert client.opened_ahead and client.request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=2.0).accepted
        with pytest.raises(grpc.RpcError) as error:  # the proxy refuses any other connection
            fresh.get(endpoint).request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=1.0)
        assert error.value.code() is grpc.StatusCode.UNAVAILABLE and "could not connect" in error.value.details()
    finally:
        ahead.close()
        fresh.close()
        proxy.close()


def test_a_channel_opened_ahead_is_not_handed_out_before_it_connects():
    """A transfer never waits behind the ahead channel's pending attempt: until that channel is
    connected, `get` gives a fresh client (as without connecting ahead), and it reaches the ctx."""
    (port,) = free_ports(1)
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=port)
    clients = ControlClients(timeout_s=0.5)
    handler = _Handler()
    handler.release.set()
    srv = None
    try:
        clients.connect_ahead([endpoint])  # nothing listens yet
        client = clients.get(endpoint)
        assert not client.opened_ahead and not client.is_ready
        srv = ControlServer(handler, "127.0.0.1", port)
        srv.start()
        assert client.request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=5.0).accepted
        assert clients.get(endpoint) is client  # a transfer's client stays until it fails
    finally:
        clients.close()
        if srv is not None:
            srv.stop(0.1)
