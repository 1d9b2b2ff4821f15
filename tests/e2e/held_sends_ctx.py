"""A real ctx worker (``python -m tests.e2e.held_sends_ctx serve-ctx -c ...``) with one fault
injected: while the file named by ``HELD_SENDS_FILE`` exists, its KV sender posts no message of
an accepted shard stream (the gen rank waits in the middle of the transfer), and it creates that
file's ``.reached`` twin the first time it holds one, so a test knows the transfer is mid-way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from helixserve import cli
from helixserve.transceiver.ctx.outbound import Outbound

HELD_SENDS_ENV = "HELD_SENDS_FILE"


def reached_file(held: Path) -> Path:
    return held.with_name(held.name + ".reached")


def _hold_sends(held: Path) -> None:
    pump = Outbound.pump

    def held_pump(self: Outbound, plane) -> None:  # noqa: ANN001 (a DataPlane)
        if held.exists():
            reached_file(held).touch()
            return
        pump(self, plane)

    Outbound.pump = held_pump


if __name__ == "__main__":
    _hold_sends(Path(os.environ[HELD_SENDS_ENV]))
    sys.exit(cli.main())
