"""What the transceiver benches' ctx process does, on CPU and on the GPU alike: hold requests for
pickup and answer raw ucxx sends between the same two processes (the same-run peers)."""

from __future__ import annotations

import time


def payload_bound(caches) -> int:  # noqa: ANN001 (a ModelCaches)
    """An upper bound of one request's payload in these caches (the whole pools + AUX)."""
    return caches.nbytes + 4096


def serve_ctx(sender, manager, freed, plane, raw, inbox, outbox, tick_s: float) -> None:  # noqa: ANN001
    """Run the gen process's commands until "stop": ``hold`` a request of N tokens (waiting for the
    previous pickup's free on its ack when the cache is full), ``connect`` the raw plane, send
    ``raw`` bytes or ``raw_messages`` (tag, offset, nbytes) pieces of ``raw`` to the gen, polling
    every ``tick_s``. Stops the sender and the plane at the end."""
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "hold":
            _, rid, num_tokens = cmd
            while not manager.can_allocate(num_tokens):  # the previous pickup is freed on its ack
                manager.free(freed.get())
            sender.hold(rid, manager.allocate(rid, num_tokens), num_tokens, [1])
            outbox.put("held")
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
