"""One RequestShard's control round trip between two processes: gRPC (as served) vs a ucxx tag
ping-pong of the same bytes.

Why: a pulled shard on one GPU moves its bytes in ~0.05 ms, but the request waited about 1 ms for
the ctx's answer (docs/benchmarks.md, `bench/transceiver.py --device cuda`). This bench measures, in the same
run and between the same two processes, what the answer costs as it is served (the KVTransfer
gRPC service: the blocking call, and the call future the gen rank uses, waited on through an
event as its poller waits) and what the same request and reply bytes cost as two UCX tag messages
on an already-open endpoint (the data plane's own worker, with ucxx's progress thread and
completion notifier). The messages are real: a `kimi-k3-mid` ShardRequest for a 512-token prompt
(its layout, block table and worker address) and the ShardReply the ctx builds for it. The server
answers a prebuilt reply, so the figures are the transport's, not the planning's. The methods take
turns (a, b, c, a, ...), so load from other processes falls on all of them alike.

    python bench/control_rtt.py --quick --out control_rtt.json
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, measure, write_json  # noqa: E402

PRESET, NUM_TOKENS, TPB = "kimi-k3-mid", 512, 64
REQ_TAG, REP_TAG = 1 << 40, (1 << 40) + 1
WAIT_S = 30.0  # bound of every wait for one message


def _messages(address: bytes) -> tuple[bytes, bytes]:
    """(ShardRequest, ShardReply) as served for one kimi-k3-mid request of NUM_TOKENS tokens."""
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.protocol import transfer_pb2 as pb
    from helixserve.transceiver.layout import ShardPlan, ShardSpec, layout_for
    from helixserve.transceiver.payloads import payload_descriptors

    cfg = get_preset(PRESET)
    layout = layout_for(cfg, torch.bfloat16, TPB, PRESET)
    num_blocks = -(-NUM_TOKENS // TPB)
    caches = allocate_model_caches(cache_spec_for(cfg, torch.bfloat16, TPB), 2 * num_blocks, 2)
    plan = ShardPlan.for_sender(ShardSpec(layout, NUM_TOKENS), caches, list(range(num_blocks, 2 * num_blocks)),
                                1, [7], 16 << 20)
    request = pb.ShardRequest(ctx_request_id="ctx-0123456789abcdef", cp_rank=0, cp_size=1,
                              layout_json=layout.model_dump_json(), ucx_worker_address=address, tag_base=12345,
                              num_prompt_tokens=NUM_TOKENS, max_message_bytes=16 << 20, deadline_ms=10_000,
                              dst_block_ids=list(range(num_blocks)), dst_slot=0)
    reply = pb.ShardReply(accepted=True, ucx_worker_address=address, message_bytes=16 << 20,
                          payloads=payload_descriptors(plan.messages, plan.kinds))
    return request.SerializeToString(), reply.SerializeToString()


class _Answer:
    """A TransferHandler answering every RequestShard with the prebuilt reply."""

    def __init__(self, reply: bytes) -> None:
        from helixserve.protocol import transfer_pb2 as pb

        self.reply = pb.ShardReply.FromString(reply)

    def request_shard(self, request):  # noqa: ANN001, ANN201
        return self.reply

    def cancel_shard(self, request):  # noqa: ANN001, ANN201
        raise NotImplementedError

    acknowledge = describe_pools = cancel_shard


def _wait(handle, wakeup: threading.Event) -> None:  # noqa: ANN001
    """Until `handle` ended (bounded), woken by the plane's completion notifier."""
    import time

    from helixserve.transceiver.base import TransferState

    end = time.monotonic() + WAIT_S
    while (state := handle.test()) is TransferState.TRANSFERRING:
        if time.monotonic() > end:
            raise TimeoutError(f"no UCX message within {WAIT_S} s")
        wakeup.wait(0.001)
        wakeup.clear()
    if state is not TransferState.COMPLETED:
        raise RuntimeError(f"UCX message ended {state.value}: {handle.error}")


def _plane():  # noqa: ANN202
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    wakeup = threading.Event()
    return UcxxDataPlane(progress_thread=True, wakeup_on_completion=True, wakeup=wakeup), wakeup


def _ctx_main(inbox, outbox) -> None:  # noqa: ANN001
    import torch

    from helixserve.transceiver.ctx.control_server import ControlServer

    plane, wakeup = _plane()
    request, reply = _messages(plane.address)
    server = ControlServer(_Answer(reply))
    outbox.put((server.start(), plane.address, reply))
    plane.connect("gen", inbox.get())
    inbox_buffer = torch.zeros(len(request), dtype=torch.uint8)
    reply_buffer = torch.frombuffer(bytearray(reply), dtype=torch.uint8)
    outbox.put("connected")
    while (rounds := inbox.get()) != "stop":  # answer `rounds` ping-pongs, then report
        for _ in range(rounds):
            _wait(plane.recv_message("gen", REQ_TAG, inbox_buffer), wakeup)
            _wait(plane.send_message("gen", REP_TAG, reply_buffer), wakeup)
        outbox.put("answered")
    server.stop()
    plane.close()


def _gen_main(port: int, ctx_address: bytes, ctx_reply: bytes, inbox, outbox, warmup: int,  # noqa: ANN001
              reps: int) -> None:
    import time

    import torch

    from helixserve.protocol import transfer_pb2 as pb
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.gen.control_client import ControlClient

    plane, wakeup = _plane()
    outbox.put(plane.address)
    plane.connect("ctx", ctx_address)
    request_bytes, _ = _messages(plane.address)
    reply_bytes = ctx_reply  # what the ctx answers (its own worker address in it)
    request = pb.ShardRequest.FromString(request_bytes)
    client = ControlClient(TransceiverEndpoint(host="127.0.0.1", port=port), timeout_s=WAIT_S)
    request_buffer = torch.frombuffer(bytearray(request_bytes), dtype=torch.uint8)
    reply_buffer = torch.zeros(len(reply_bytes), dtype=torch.uint8)
    answered = threading.Event()

    def grpc_blocking() -> None:
        assert client.request_shard(request).accepted

    def grpc_future() -> None:  # as Inbound.ask: the call future, its reply seen through an event
        answered.clear()
        future = client.request_shard_async(request)
        future.add_done_callback(lambda _: answered.set())
        if not answered.wait(WAIT_S):
            raise TimeoutError("no RequestShard answer")
        assert future.result().accepted

    def ucxx_tags() -> None:
        handle = plane.recv_message("ctx", REP_TAG, reply_buffer)
        sent = plane.send_message("ctx", REQ_TAG, request_buffer)
        _wait(handle, wakeup)  # the reply implies the request landed
        _wait(sent, wakeup)

    assert inbox.get() == "go"
    times = measure([grpc_blocking, grpc_future, ucxx_tags], warmup, reps)
    assert bytes(reply_buffer.numpy()) == reply_bytes
    outbox.put({"grpc_blocking": times[0], "grpc_future": times[1], "ucxx_tags": times[2],
                "request_bytes": len(request_bytes), "reply_bytes": len(reply_bytes)})
    client.close()
    time.sleep(0.1)
    plane.close()


def run(warmup: int, reps: int) -> dict:
    ctx = mp.get_context("spawn")
    ctx_in, ctx_out, gen_in, gen_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ctx_proc = ctx.Process(target=_ctx_main, args=(ctx_in, ctx_out))
    ctx_proc.start()
    gen_proc = None
    try:
        port, ctx_address, ctx_reply = ctx_out.get(timeout=120)
        gen_proc = ctx.Process(target=_gen_main, args=(port, ctx_address, ctx_reply, gen_in, gen_out, warmup, reps))
        gen_proc.start()
        ctx_in.put(gen_out.get(timeout=120))
        assert ctx_out.get(timeout=60) == "connected"
        ctx_in.put(warmup + reps)  # the ucxx ping-pongs the gen will make
        gen_in.put("go")
        result = gen_out.get(timeout=600)
        assert ctx_out.get(timeout=60) == "answered"
        return result
    finally:
        ctx_in.put("stop")
        for proc in (gen_proc, ctx_proc):
            if proc is not None:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    reps = args.reps or (100 if args.quick else 500)
    result = run(warmup=20, reps=reps)
    future_p50 = statistics.median(result["grpc_future"])
    rows, records = [], []
    for name, label in (("grpc_blocking", "gRPC RequestShard, blocking call"),
                        ("grpc_future", "gRPC RequestShard, call future + event (as served)"),
                        ("ucxx_tags", "ucxx tag send + tag reply, same bytes")):
        samples = sorted(result[name])
        p50, p90 = statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]
        rows.append([label, p50 * 1e3, p90 * 1e3, p50 / future_p50])
        records.append({"method": name, "p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3,
                        "ratio_vs_grpc_future": p50 / future_p50, "samples_s": result[name]})
    print(f"\n{PRESET} RequestShard ({result['request_bytes']} B) and ShardReply ({result['reply_bytes']} B), "
          f"2 processes, one host, {reps} round trips each\n")
    print(markdown_table(["method", "p50 ms", "p90 ms", "p50 / gRPC future"], rows))
    write_json(args.out, {"bench": "control_rtt", "preset": PRESET, "tokens": NUM_TOKENS, "reps": reps,
                          "request_bytes": result["request_bytes"], "reply_bytes": result["reply_bytes"],
                          "machine": machine_info(), "results": records})


if __name__ == "__main__":
    main()
