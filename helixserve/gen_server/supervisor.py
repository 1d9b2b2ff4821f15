"""Restarting a gen worker's world after it failed (:class:`WorldSupervisor`).

A world fails when a rank process dies or a collective fails (:class:`~.world.GenWorld` notices
it on the engine thread, and fails every request in flight with a 503 ``gen_world_failed``).
Then, on a thread of its own (the worker keeps answering ``/health`` with 503 and refusing new
requests with 503 meanwhile), the supervisor:

1. closes the failed world: the surviving spawned ranks are killed after a short grace, rank 0
   leaves its process groups, its KV receiver is closed;
2. waits the policy's backoff (:class:`~helixserve.serving.restarts.RestartBudget`) and starts a
   fresh world (new rendezvous, ranks spawned again, shards loaded again, one warm-up request
   through every rank); a start that fails counts as a failure too;
3. hands the new world to the engine thread (:meth:`take_ready`), which swaps it in: the worker
   is healthy again.

When the policy's restarts are spent, or when the world cannot be restarted from here (srun /
torchrun started its ranks), the supervisor gives up: :attr:`exit_code` becomes 1 and the worker
process is asked to stop (SIGTERM to itself: uvicorn's graceful shutdown), so that whatever
started it (compose, SLURM, ``helixserve launch``) starts it again.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from helixserve.config import RestartPolicy
from helixserve.engine.world_llm import LocalWorld
from helixserve.serving.restarts import RestartBudget

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0  # how long the failed world's surviving ranks get to exit before SIGKILL
JOIN_TIMEOUT_S = 60.0  # closing the worker waits this long for a restart in progress


def stop_this_process() -> None:
    """Ask this process to shut down the way Ctrl-C / ``docker stop`` would."""
    os.kill(os.getpid(), signal.SIGTERM)


class WorldSupervisor:
    """Restarts of one gen worker's world under ``policy``; ``start`` builds a fresh local world
    (None: the ranks are external, the world cannot be restarted here)."""

    def __init__(self, policy: RestartPolicy, start: Callable[[], LocalWorld] | None,
                 on_give_up: Callable[[], None] = stop_this_process) -> None:
        self.policy = policy
        self._start = start
        self._on_give_up = on_give_up
        self.budget = RestartBudget(policy)
        self.status: str | None = None  # what /health says while a restart is under way
        self.exit_code: int | None = None  # 1 once it gave up
        self._ready: LocalWorld | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_restarting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self, cause: str, close_failed: Callable[[], None]) -> None:
        """The current world failed with ``cause``: close it, then restart (or give up)."""
        then = "restart it" if self._start is not None else "exit (srun / torchrun started its ranks)"
        self.status = f"the gen world failed; closing it to {then}: {cause}"
        self._thread = threading.Thread(target=self._run, args=(cause, close_failed),
                                        name="gen-world-restart", daemon=True)
        self._thread.start()

    def take_ready(self) -> LocalWorld | None:
        """The restarted world, once (engine thread), or None."""
        world, self._ready = self._ready, None
        return world

    def close(self) -> None:
        """Stop restarting; close a world started but not taken (the worker is shutting down)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
        world, self._ready = self._ready, None
        if world is not None:
            world.close()

    def _run(self, cause: str, close_failed: Callable[[], None]) -> None:
        try:
            close_failed()
        except Exception as exc:  # noqa: BLE001 - what is left of it dies with the process
            logger.warning("closing the failed gen world: %s: %s", type(exc).__name__, exc)
        while not self._stopping.is_set():
            if self._start is None:
                return self._give_up(cause, "its ranks were started by srun / torchrun, not here")
            delay = self.budget.next_delay()
            if delay is None:
                return self._give_up(cause, f"it failed {self.policy.max_restarts + 1} times within "
                                            f"{self.policy.window_s:g} s (world_restart.max_restarts="
                                            f"{self.policy.max_restarts})")
            self.status = (f"the gen world is restarting ({self.budget.describe()}, in {delay:g} s) "
                           f"after: {cause}")
            logger.warning("%s", self.status)
            if self._stopping.wait(delay):
                return None
            try:
                world = self._start()
            except Exception as exc:  # noqa: BLE001 - counted as one more failure
                cause = f"restarting it failed: {type(exc).__name__}: {exc}"
                logger.error("%s", cause)
                continue
            if self._stopping.is_set():
                world.close()
                return None
            logger.warning("gen world restarted (%s)", self.budget.describe())
            self._ready = world
            return None
        return None

    def _give_up(self, cause: str, why: str) -> None:
        self.status = f"the gen world failed and is not restarted ({why}): {cause}"
        self.exit_code = 1
        logger.error("%s; stopping this gen worker (exit code 1)", self.status)
        self._on_give_up()
