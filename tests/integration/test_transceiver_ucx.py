"""Real UCX between two processes: a multi-chunk buffer arrives byte-exact; waits are bounded."""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time

import pytest

pytest.importorskip("ucxx")

NBYTES = (24 << 20) + 12345  # several chunks plus an odd tail
CHUNK = 4 << 20
TIMEOUT_S = 20.0


def _pattern(nbytes: int):
    import torch

    return (torch.arange(nbytes, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def _plane(rank: int, addresses_out, addresses_in, peer: int):
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    plane = UcxxDataPlane(rank, chunk_bytes=CHUNK)
    addresses_out.put(plane.address)
    plane.connect(peer, addresses_in.get(timeout=30))
    return plane


def _receiver_main(mine, theirs, results, scenario: str) -> None:
    import torch

    from helixserve.transceiver.base import PayloadKind, ReceiverSession
    from helixserve.transceiver.polling import TransferPoller

    plane = _plane(1, mine, theirs, peer=0)
    timeout_s = TIMEOUT_S if scenario == "loopback" else 0.5
    session = ReceiverSession("req-1", timeout_s=timeout_s)
    session.add_task(0, PayloadKind.KV_BLOCKS, NBYTES)
    buffer = torch.zeros(NBYTES, dtype=torch.uint8)
    poller = TransferPoller()
    poller.add(session)
    start = time.monotonic()
    session.attach(0, PayloadKind.KV_BLOCKS, plane.post_recv(0, tag=42, buffer=buffer))
    results.put(("posted", None))
    while poller.live_sessions():
        result = poller.poll(wait_num=1, interval_s=0.05)  # bounded, like an executor step
    elapsed = time.monotonic() - start
    out = {"state": session.state.value, "error": session.error, "elapsed": elapsed,
           "equal": bool(torch.equal(buffer, _pattern(NBYTES))),
           "quarantined": list(result.quarantined)}
    plane.close_peer(0)  # the peer is given up: closing cancels the posted receive
    out["quiesced_after_close"] = session.is_quiesced
    results.put(("done", out))
    plane.close()


def _sender_main(mine, theirs, results, scenario: str) -> None:
    from helixserve.transceiver.base import TransferState

    plane = _plane(0, mine, theirs, peer=1)
    if scenario == "loopback":
        handle = plane.post_send(1, tag=42, buffer=_pattern(NBYTES))
        end = time.monotonic() + TIMEOUT_S
        while not handle.test().is_settled and time.monotonic() < end:
            time.sleep(0.0005)
        results.put(("sent", handle.test() is TransferState.COMPLETED))
    # "silent" scenario: connected but never sends; stay alive until the receiver is done
    time.sleep(1.0 if scenario == "silent" else 0.2)
    plane.close()


def _run(scenario: str) -> dict:
    ctx = mp.get_context("spawn")
    a_to_b, b_to_a, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_receiver_main, args=(b_to_a, a_to_b, results, scenario)),
             ctx.Process(target=_sender_main, args=(a_to_b, b_to_a, results, scenario))]
    for proc in procs:
        proc.start()
    got: dict = {}
    try:
        while "done" not in got:
            kind, value = results.get(timeout=60)
            got[kind] = value
    except queue.Empty:
        pytest.fail(f"UCX {scenario} test produced no result within 60 s: {got}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return got


def test_transceiver_ucx_multichunk_loopback_is_byte_exact():
    got = _run("loopback")
    done = got["done"]
    assert done["state"] == "completed", done["error"]
    assert done["equal"] and got.get("sent") is True
    logging.getLogger(__name__).info(
        "ucxx loopback %.1f MiB in %.3fs = %.2f GB/s", NBYTES / 2**20, done["elapsed"],
        NBYTES / done["elapsed"] / 1e9)


def test_transceiver_ucx_silent_peer_fails_within_deadline_and_quarantines():
    done = _run("silent")["done"]
    assert done["state"] == "failed" and "timed out" in done["error"]
    assert done["elapsed"] < 0.5 + 0.5  # deadline + a poll interval, generously
    assert done["quarantined"] == ["req-1"]  # the receive was still posted: never reuse
    assert done["quiesced_after_close"]


@pytest.mark.parametrize("is_notified", [True, False])
def test_transceiver_ucx_completion_sets_the_wakeup_event(is_notified):
    """With the progress thread, a completed request sets the plane's wakeup event (a poller
    waiting on it wakes at once, not at its next tick); with the notifier off it stays unset."""
    import threading

    import torch

    from helixserve.transceiver.base import TransferState
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    wakeup = threading.Event()
    plane = UcxxDataPlane(progress_thread=True, wakeup=wakeup, wakeup_on_completion=is_notified)
    try:
        peer = plane.connect_worker(plane.address)
        src, dst = _pattern(1 << 20), torch.zeros(1 << 20, dtype=torch.uint8)
        recv = plane.recv_message(peer, 7, dst)
        time.sleep(0.05)
        wakeup.clear()
        send = plane.send_message(peer, 7, src)
        assert wakeup.wait(2.0) is is_notified
        end = time.monotonic() + TIMEOUT_S
        while not (recv.test().is_terminal and send.test().is_terminal) and time.monotonic() < end:
            time.sleep(0.001)
        assert recv.test() is TransferState.COMPLETED and torch.equal(dst, src)
    finally:
        plane.close()
    with pytest.raises(ValueError, match="progress_thread"):
        UcxxDataPlane(wakeup_on_completion=True)


def test_transceiver_ucx_requests_posted_from_other_threads_complete():
    """ucxx gives each request a completion future, made on the posting thread when its pool
    runs dry; threads without an asyncio loop (the KV sender's, an engine thread) must still get
    requests that complete (they once hung until the transfer deadline)."""
    import threading

    import torch

    from helixserve.transceiver.base import TransferState
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    plane = UcxxDataPlane(progress_thread=True)
    states: list[TransferState] = []

    def post_many() -> None:
        peer = plane.connect_worker(plane.address)
        src = [_pattern(1024 + i) for i in range(400)]  # more requests than ucxx's future pool
        dst = [torch.zeros(1024 + i, dtype=torch.uint8) for i in range(400)]
        handles = [plane.recv_message(peer, 1000 + i, d) for i, d in enumerate(dst)]
        handles += [plane.send_message(peer, 1000 + i, s) for i, s in enumerate(src)]
        end = time.monotonic() + TIMEOUT_S
        while not all(h.test().is_terminal for h in handles) and time.monotonic() < end:
            time.sleep(0.001)
        states.extend(h.test() for h in handles)
        states.append(TransferState.COMPLETED if all(torch.equal(a, b) for a, b in zip(src, dst))
                      else TransferState.FAILED)

    try:
        thread = threading.Thread(target=post_many)
        thread.start()
        thread.join(TIMEOUT_S + 5)
        assert not thread.is_alive()
        assert len(states) == 801 and set(states) == {TransferState.COMPLETED}
    finally:
        plane.close()


_PLANE_PROBE = """
import os, sys
from pathlib import Path
from helixserve.transceiver.ucxx_backend import UcxxDataPlane
from helixserve.transceiver.ucxx_backend.devices import net_devices_for
kwargs = {"net_devices": net_devices_for("127.0.0.1")} if sys.argv[1] == "loopback" else {}
a, b = UcxxDataPlane(progress_thread=True, **kwargs), UcxxDataPlane(progress_thread=True, **kwargs)
b.connect_worker(a.address)
inodes = {fd.readlink().name[8:-1] for fd in Path("/proc/self/fd").iterdir()
          if fd.is_symlink() and fd.readlink().name.startswith("socket:[")}
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in Path(table).read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:
            print("LISTEN", f[1].split(":")[0])
a.close(); b.close()
"""


def _probe_planes(mode: str) -> tuple[list[str], str]:
    """Two planes in a fresh process (its environment as a deployment's: no UCX_* preset):
    the addresses their UCX TCP transports listen on, and what UCX logged (on stdout and stderr)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _PLANE_PROBE, mode], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return ([line.split()[1] for line in done.stdout.splitlines() if line.startswith("LISTEN")],
            done.stdout + done.stderr)


def test_ucx_starts_without_warnings_and_listens_on_the_configured_interface_only():
    """Finding 7 (UCX warned 'unused environment variable: UCX_MEMTYPE_CACHE' on every start) and
    finding 3 (UCX listened beyond the configured host): with the loopback host, every TCP listener
    of the data plane is on 127.0.0.1."""
    listening, logged = _probe_planes("loopback")
    assert "UCX  WARN" not in logged and "UCX_MEMTYPE_CACHE" not in logged, logged
    assert listening and set(listening) == {"0100007F"}, listening
