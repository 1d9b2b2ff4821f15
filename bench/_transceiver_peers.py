"""What the transceiver benches' ctx process does, on CPU and on the GPU alike: hold requests for
hold and answer raw ucxx sends between the same two processes (the same-run peers)."""

from __future__ import annotations

import time


def payload_bound(caches) -> int:  # noqa: ANN001 (a ModelCaches)
    """An upper bound of one request's payload in these caches (the whole pools + AUX)."""
    return caches.nbytes + 4096


def serve_ctx(sender, manager, freed, plane, raw, inbox, outbox, tick_s: float) -> None:  # noqa: ANN001
    """Run the gen process's commands until "stop": ``hold`` a request of N tokens (waiting for the
    previous hold's free on its ack when the cache is full), ``connect`` the raw plane, send
    ``raw`` bytes or ``raw_messages`` (tag, offset, nbytes) pieces of ``raw`` to the gen, polling
    every ``tick_s``. Stops the sender and the plane at the end."""
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "hold":
            _, rid, num_tokens = cmd
            while not manager.can_allocate(num_tokens):  # the previous hold is freed on its ack
                manager.free(freed.get())
            grant = sender.hold(rid, manager.allocate(rid, num_tokens), num_tokens, [1])
            outbox.put(("held", grant.model_dump() if grant is not None else None))
        elif cmd[0] == "connect":
            plane.connect("gen", cmd[1])
            outbox.put("connected")
        elif cmd[0] in ("raw", "raw_messages"):
            pieces = [(cmd[2], 0, cmd[1])] if cmd[0] == "raw" else cmd[1]
            handles = [plane.send_message("gen", tag, raw[start : start + n]) for tag, start, n in pieces]
            while not all(h.is_quiesced() for h in handles):
                time.sleep(tick_s)
            outbox.put("sent")
    sender.stop()
    plane.close()


def receive_raw(plane, buffer, cmd: tuple, inbox, outbox, tick_s: float) -> None:  # noqa: ANN001
    """The gen side of one raw round: post the receive(s) of ``cmd`` (``("raw", nbytes, tag)`` or
    ``("raw_messages", [(tag, offset, nbytes), ...])``) into ``buffer``, say "posted", wait for
    "go", then put the seconds until every one landed (polling every ``tick_s``)."""
    from helixserve.transceiver.base import TransferState

    pieces = [(cmd[2], 0, cmd[1])] if cmd[0] == "raw" else cmd[1]
    handles = [plane.recv_message("ctx", tag, buffer[start : start + n]) for tag, start, n in pieces]
    outbox.put("posted")
    assert inbox.get() == ("go",)
    start = time.perf_counter()
    while any(h.test() is TransferState.TRANSFERRING for h in handles):
        time.sleep(tick_s)
    outbox.put(time.perf_counter() - start)


def raw_round(ctx_queues, gen_queues, cmd: tuple) -> float:  # noqa: ANN001
    """The driver's side of one raw round between the two processes (``serve_ctx`` sends,
    ``receive_raw`` receives): the seconds the gen measured, receives posted first."""
    (ctx_in, ctx_out), (gen_in, gen_out) = ctx_queues, gen_queues
    gen_in.put(cmd)
    assert gen_out.get(timeout=60) == "posted"
    ctx_in.put(cmd)
    gen_in.put(("go",))
    seconds = gen_out.get(timeout=120)
    assert ctx_out.get(timeout=60) == "sent"
    return seconds


def serving_receiver(receiver, caches):  # noqa: ANN001, ANN201 (a KVReceiver, ModelCaches)
    """`receiver` driven as a gen rank serves: the engine's `RankTransfers` (its consensus, cp 1)
    over the gen server's `PacedKVReceiver` (a poll waits up to the config's poll interval when
    nothing else would run, as in an idle engine step)."""
    from helixserve.engine.kv_intake import RankTransfers
    from helixserve.gen_server.kv_source import PacedKVReceiver
    from helixserve.transceiver.consensus import TransferConsensus

    return RankTransfers(PacedKVReceiver(receiver, receiver.config.poll_interval_s), caches,
                         TransferConsensus(is_local=True))


def receive_one(transfers, manager, layout, rid: str, num_tokens: int, endpoint,  # noqa: ANN001
                grant: dict | None = None) -> tuple[float, float]:
    """One request's transfer on the gen side as the engine serves it (`serving_receiver`): the
    cache allocated, the reception started, then idle steps' polls and agreements until the
    request is ready (with the ctx's pull `grant` when given); its cache freed after.
    ``(perf_counter at the allocation, seconds)``."""
    from helixserve.protocol.disagg import DisaggregatedParams
    from helixserve.transceiver.ticket import KVTicket

    params = DisaggregatedParams(request_type="generation_only", ctx_request_id=rid, first_gen_tokens=[1],
                                 prompt_token_ids=[1] * num_tokens, ctx_endpoint=endpoint, layout=layout,
                                 pull_grant=grant)
    start = time.perf_counter()
    transfers.start(rid, manager.allocate(rid, num_tokens), KVTicket.from_params(params))
    while rid not in (agreed := transfers.agree(wait=True)).ready:
        assert rid not in agreed.failed | agreed.cancelled, agreed.errors
    elapsed = time.perf_counter() - start
    manager.free(rid)
    return start, elapsed
