"""A real ctx worker (``python -m tests.e2e.held_sends_ctx serve-ctx -c ...``) with one fault
injected: while the file named by ``HELD_SENDS_FILE`` exists, its KV sender posts no message of
an accepted shard stream (the gen rank waits in the middle of the transfer), and the first time
it holds one it adds its pid to that file's ``.reached`` twin, so a test knows the transfer is
mid-way. A ctx world's spawned ranks run this module as their main (``__mp_main__``): every
rank's sender holds its streams so, each adding its own pid."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from helixserve import cli
from helixserve.transceiver.ctx.outbound import Outbound

HELD_SENDS_ENV = "HELD_SENDS_FILE"


def reached_file(held: Path) -> Path:
    return held.with_name(held.name + ".reached")


def holding_pids(held: Path) -> set[int]:
    """The processes whose sender held a stream (listed in ``held``'s ``.reached`` twin)."""
    reached = reached_file(held)
    return {int(pid) for pid in reached.read_text().split()} if reached.exists() else set()


def _hold_sends(held: Path) -> None:
    pump = Outbound.pump

    def held_pump(self: Outbound, plane) -> None:  # noqa: ANN001 (a DataPlane)
        if held.exists():
            if os.getpid() not in holding_pids(held):
                with reached_file(held).open("a") as reached:
                    reached.write(f"{os.getpid()}\n")
            return
        pump(self, plane)

    Outbound.pump = held_pump


if __name__ in ("__main__", "__mp_main__"):
    _hold_sends(Path(os.environ[HELD_SENDS_ENV]))
if __name__ == "__main__":
    sys.exit(cli.main())
