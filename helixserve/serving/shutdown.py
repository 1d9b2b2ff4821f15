"""Stopping this worker process from inside it (torch-free): a worker that gives up (its warm-up
failed, its gen world's restarts are spent) asks itself to stop the way Ctrl-C / ``docker stop``
would, so that uvicorn shuts down gracefully and whatever started it starts it again."""

from __future__ import annotations

import os
import signal


def stop_this_process() -> None:
    """Ask this process to shut down the way Ctrl-C / ``docker stop`` would (SIGTERM to itself)."""
    os.kill(os.getpid(), signal.SIGTERM)
