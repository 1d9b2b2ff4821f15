"""The e2e harness itself: stopping a deployment whose ctx already exited (a failed start) still
stops every other role (the dead one's ProcessLookupError does not leave the gen world and the
router running for the rest of the suite, holding cores and ports)."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e.conftest import Deployment


def test_stop_stops_every_role_when_one_already_exited() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait(30)
    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            for _ in range(2)]
    d = Deployment.__new__(Deployment)  # only its processes: no checkpoint needed
    d.procs = {"ctx": dead, "gen": live[0], "router": live[1]}
    try:
        d.stop()
        assert d.procs == {}
        assert all(proc.poll() is not None for proc in live)
    finally:
        for proc in live:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
