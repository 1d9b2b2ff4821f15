"""The ``forkserver`` that local world ranks are spawned from, started so that a SIGTERM to this
process's group leaves it alone.

The forkserver is the parent of every rank forked from it and the only source of their exit
status: were it killed, every rank it forked would read as exited with code 255 while still
running (``multiprocessing.popen_forkserver`` reports a lost forkserver so), and a gen worker
would take an orderly stop (``helixserve launch``'s SIGTERM to each process group, ``kill --
-PGID``) for a dead rank. A SIGTERM to the group is rank 0's to handle: it shuts its ranks down
(which ignore SIGTERM too); the forkserver ends when rank 0 does (or with the group's SIGKILL).
"""

from __future__ import annotations

import multiprocessing.forkserver
import signal
import threading


def start_forkserver() -> None:
    """Start this process's forkserver if it is not running, ignoring SIGTERM (the disposition
    survives its exec; a blocked signal mask does not).

    Off the main thread (a world restarted by the gen worker's supervisor) the forkserver is
    usually running already; one started there keeps the default SIGTERM disposition, as the
    disposition can be changed only on the main thread. On the main thread, a SIGTERM that
    arrives during the few milliseconds of the forkserver's fork and exec is ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
