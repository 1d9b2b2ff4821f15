"""A worker's world (a gen world, a ctx world) as one object that outlives restarts
(:class:`ServedWorld`), and restarting it after it failed (:class:`WorldSupervisor`).

A world fails when a rank process dies or a collective fails (:class:`ServedWorld` notices it on
the engine thread, and :class:`~.world_core.WorldCore` fails every request in flight with a 503
``<role>_world_failed``).
Then, on a thread of its own (the worker keeps answering ``/health`` with 503 and refusing new
requests with 503 meanwhile), the supervisor:

1. closes the failed world: the surviving spawned ranks are killed after a short grace, rank 0
   leaves its process groups, its KV receiver is closed;
2. waits the policy's backoff (:class:`~helixserve.launch.restarts.RestartBudget`) and starts a
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
import threading
import time
from collections.abc import Callable
from typing import Any

from typing import Protocol

from prometheus_client.core import GaugeMetricFamily

from helixserve.config_lifecycle import RestartPolicy
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.serving.local_world import LocalWorld
from helixserve.launch.restarts import RestartBudget
from helixserve.serving.shutdown import stop_this_process

logger = logging.getLogger(__name__)

# internal: a collective fails as soon as a peer's socket closes, a moment before the dead rank's
# exit shows; the failure's cause waits this long for it (only to name the rank; nothing hangs on it)
DEAD_RANK_WAIT_S = 1.0
DEAD_RANK_TICK_S = 0.02


class WorldSettings(Protocol):
    """A world worker's settings the supervisor reads (``GenServerConfig``, ``CtxServerConfig``)."""

    @property
    def world_restart(self) -> RestartPolicy: ...
    @property
    def world_stop_grace_s(self) -> float: ...
    @property
    def failed_world_grace_s(self) -> float: ...
    @property
    def restart_join_timeout_s(self) -> float: ...


class WorldSupervisor:
    """Restarts of one worker's world under ``server.world_restart``; ``start`` builds a
    fresh local world (None: the ranks are external, the world cannot be restarted here). The
    world's waits come from ``server`` (``world_stop_grace_s``, ``failed_world_grace_s``,
    ``restart_join_timeout_s``); ``role`` names the world in its messages."""

    def __init__(self, server: WorldSettings, start: Callable[[], LocalWorld] | None, role: str,
                 on_give_up: Callable[[], None] = stop_this_process) -> None:
        self.server = server
        self.role = role
        self.policy = policy = server.world_restart
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
        self.status = f"the {self.role} world failed; closing it to {then}: {cause}"
        self._thread = threading.Thread(target=self._run, args=(cause, close_failed),
                                        name=f"{self.role}-world-restart", daemon=True)
        self._thread.start()

    def take_ready(self) -> LocalWorld | None:
        """The restarted world, once (engine thread), or None."""
        world, self._ready = self._ready, None
        return world

    def close(self) -> None:
        """Stop restarting; close a world started but not taken (the worker is shutting down)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.server.restart_join_timeout_s)
        world, self._ready = self._ready, None
        if world is not None:
            world.close()

    def _run(self, cause: str, close_failed: Callable[[], None]) -> None:
        try:
            close_failed()
        except Exception as exc:  # noqa: BLE001 - what is left of it dies with the process
            logger.warning("closing the failed %s world: %s: %s", self.role, type(exc).__name__, exc)
        while not self._stopping.is_set():
            if self._start is None:
                return self._give_up(cause, "its ranks were started by srun / torchrun, not here")
            delay = self.budget.next_delay()
            if delay is None:
                return self._give_up(cause, f"it failed {self.policy.max_restarts + 1} times within "
                                            f"{self.policy.window_s:g} s (world_restart.max_restarts="
                                            f"{self.policy.max_restarts})")
            self.status = (f"the {self.role} world is restarting ({self.budget.describe()}, in {delay:g} s) "
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
            logger.warning("%s world restarted (%s)", self.role, self.budget.describe())
            self._ready = world
            return None
        return None

    def _give_up(self, cause: str, why: str) -> None:
        self.status = f"the {self.role} world failed and is not restarted ({why}): {cause}"
        self.exit_code = 1
        logger.error("%s; stopping this %s worker (exit code 1)", self.status, self.role)
        self._on_give_up()


class ServedWorld:
    """Rank 0's driver and the ranks spawned here (none when srun / torchrun started them), as
    one object that outlives restarts: after the world failed, :attr:`supervisor` closes it and
    starts a fresh one, which the engine thread swaps in (:meth:`take_restarted`)."""

    def __init__(self, driver: WorldDriver, local: LocalWorld | None, supervisor: WorldSupervisor) -> None:
        self.driver = driver
        self.local = local
        self.supervisor = supervisor
        self.role = supervisor.role
        self._is_failed = False  # this incarnation's failure was noticed (its requests failed)

    @property
    def exit_code(self) -> int | None:
        """1 once the world failed for good (the worker should exit with it), else None."""
        return self.supervisor.exit_code

    def failure(self) -> str | None:
        """Why the world cannot serve (restarting, given up, dead spawned ranks, a stopped
        world), or None."""
        if self._is_failed:
            return self.supervisor.status or f"the {self.role} world failed"
        return self._incarnation_failure()

    def _incarnation_failure(self) -> str | None:
        causes = [self.dead_ranks(), self.driver.failure and f"the {self.role} world stopped: {self.driver.failure}"]
        return "; ".join(c for c in causes if c) or None

    def notice_failure(self) -> str | None:
        """Engine thread: the current world's failure, once; its close and restart begin."""
        if self._is_failed:
            return None
        if self._incarnation_failure() is None:
            return None
        self._await_dead_ranks()
        cause = self._incarnation_failure()
        assert cause is not None
        self._is_failed = True
        self.driver.failure = self.driver.failure or cause  # nothing more is sent to it
        logger.error("%s world failed: %s", self.role, cause)
        self.supervisor.begin(cause, self._close_incarnation)
        return cause

    def _await_dead_ranks(self, timeout_s: float = DEAD_RANK_WAIT_S) -> None:
        """A collective fails as soon as a peer's socket closes, a moment before the dead rank's
        exit can be seen: wait (bounded) for one to show, so that the cause names it."""
        if self.local is None or self.dead_ranks() is not None:
            return
        deadline = time.monotonic() + timeout_s
        while self.dead_ranks() is None and time.monotonic() < deadline:
            time.sleep(DEAD_RANK_TICK_S)

    def take_restarted(self) -> bool:
        """Engine thread: swap in the world the supervisor restarted, if one is ready."""
        local = self.supervisor.take_ready()
        if local is None:
            return False
        assert isinstance(local.driver, WorldDriver)
        self.driver, self.local, self._is_failed = local.driver, local, False
        self.supervisor.status = None
        return True

    def dead_ranks(self) -> str | None:
        """The spawned ranks that exited, or None."""
        if self.local is None:
            return None
        dead = [f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                for rank, proc in enumerate(self.local.processes, start=1) if not proc.is_alive()]
        return f"{self.role} world " + ", ".join(dead) if dead else None

    def describe(self) -> dict[str, Any]:
        """The world's shape, its spawned ranks' pids (rank 0 and launcher-started ranks: None),
        its failure and restarts, for ``/health``."""
        pids = [None] + ([p.pid for p in self.local.processes] if self.local else [])
        mapping = self.driver.mapping
        return {"dp": mapping.dp, "cp": mapping.cp, "rank_pids": pids, "failure": self.failure(),
                "restarts": self.supervisor.budget.num_restarts}

    def rank_gauges(self) -> list[tuple[str, str, dict[tuple[int, int], float]]]:
        """``(name, help, {(dp_rank, cp_rank): value})`` of every rank's cache, as reported after
        the last world step (the unlabelled ``cache_blocks_*`` / ``state_slots_*`` gauges are
        their sums over every rank); no values while the world is failed (its ranks are gone)."""
        stats = {} if self.failure() is not None else self.driver.rank_stats()
        fields = (("rank_cache_blocks_used", "MLA cache blocks in use on one world rank", "num_used_blocks"),
                  ("rank_cache_blocks_total", "MLA cache blocks of one world rank", "num_blocks"),
                  ("rank_state_slots_used", "KDA state slots in use on one world rank", "num_used_slots"),
                  ("rank_state_slots_total", "KDA state slots of one world rank", "num_slots"))
        return [(name, text, {key: float(getattr(s, attr)) for key, s in stats.items()})
                for name, text, attr in fields]

    def close(self) -> None:
        """After the engine thread stopped: stop restarting, shut the ranks down, close rank 0's
        receiver (a ctx world: its KV sender)."""
        self.supervisor.close()
        if not self._is_failed:
            self._close_incarnation()

    def _close_incarnation(self) -> None:
        driver, local = self.driver, self.local
        receiver = driver.core.transfers.receiver
        try:
            if local is not None:
                server = self.supervisor.server
                local.close(grace_s=server.failed_world_grace_s if driver.failure else server.world_stop_grace_s)
            else:
                try:
                    driver.shutdown()
                except Exception as exc:  # noqa: BLE001 - the world is going away anyway
                    logger.warning("%s world shutdown plan failed: %s", self.role, exc)
                driver.groups.destroy()
        finally:
            if receiver is not None:
                receiver.close()
            if driver.core.kv_holds is not None:  # a ctx world: rank 0's KV sender
                driver.core.kv_holds.close()


class RankCacheCollector:
    """``/metrics``: every world rank's cache blocks and state slots (a gen world's, a ctx
    world's), labelled by ``dp_rank`` and ``cp_rank`` (each CP rank holds its own share of a
    request's blocks). The unlabelled ``helixserve_worker_cache_blocks_*`` / ``state_slots_*``
    gauges are their sums."""

    def __init__(self, role: str, world: ServedWorld) -> None:
        self.role = role
        self.world = world

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        for name, help_text, values in self.world.rank_gauges():
            gauge = GaugeMetricFamily(f"helixserve_worker_{name}", help_text, labels=["role", "dp_rank", "cp_rank"])
            for (dp_rank, cp_rank), value in sorted(values.items()):
                gauge.add_metric([self.role, str(dp_rank), str(cp_rank)], value)
            yield gauge
