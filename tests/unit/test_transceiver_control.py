"""Control plane: generated stubs are current, every call has a deadline, handler errors come back
as named replies, and a sender's message list is checked against ours."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.transceiver.control import (GENERATED, PROTO, ControlClient, ControlServer, check_payloads,
                                            generate_stubs)


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
    srv = ControlServer(handler, "127.0.0.1", 0)
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
        client.request_shard(pb.ShardRequest(ctx_request_id="r"), timeout_s=10.0)  # capped at 0.3 s
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 1.5
    future = client.request_shard_async(pb.ShardRequest(ctx_request_id="r"), timeout_s=0.1)
    assert future.exception(timeout=2.0).code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.cancel(pb.CancelRequest(ctx_request_id="r")).num_posted_messages == 3
    assert client.acknowledge_async(pb.AckRequest(ctx_request_id="r")).result(timeout=2.0).known


def test_a_failing_handler_answers_with_a_named_error(server):
    _, client = server
    reply = client.request_shard(pb.ShardRequest(ctx_request_id="boom"))
    assert not reply.accepted and "RuntimeError: kaput" in reply.error


def test_unreachable_server_fails_fast_with_unavailable():
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=1), timeout_s=2.0)
    with pytest.raises(grpc.RpcError) as error:
        client.cancel(pb.CancelRequest(ctx_request_id="r"))
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
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
