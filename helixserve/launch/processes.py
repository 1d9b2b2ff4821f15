"""Run a function on a local world of processes (CLI ``--dp/--cp`` on one machine, tests).

``run_local_world(fn, world_size, *args)`` starts ``world_size`` processes, calls
``fn(rank, world_size, init_method, *args)`` in each (``init_method`` is a free
``tcp://127.0.0.1:PORT`` to pass to :func:`helixserve.parallel.groups.init_parallel`) and returns
the results in rank order. A failing rank raises :class:`LocalWorldError` in the parent with
every failing rank's traceback; ranks still running after a grace period are killed, so a broken
world ends with an error, never a hang.

Processes come from a ``forkserver`` with torch preloaded (about 50 ms per world instead of a
few seconds of ``spawn``); ``fn`` and its args must be picklable (a module-level function). The
forkserver ignores SIGTERM (:mod:`helixserve.parallel.forkserver`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from helixserve.config import WorldRunConfig, reserved_ports
from helixserve.parallel.forkserver import start_forkserver
from helixserve.parallel.ports import free_port

logger = logging.getLogger(__name__)

_PRELOAD = ["torch", "torch.distributed", "helixserve.parallel"]


class LocalWorldError(RuntimeError):
    """One or more ranks of a local world failed, died, or the world ran past its timeout."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    args: tuple,
    num_threads: int | None,
    results: Any,
) -> None:
    try:
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        results.put((rank, True, fn(rank, world_size, init_method, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


# internal waits of the parent (none bounds the world: ``timeout_s`` / ``grace_s`` do)
RESULT_TICK_S = 0.1  # longest wait for a rank's result before checking for dead processes
LATE_RESULT_WAIT_S = 1.0  # a rank that exited gets this long for its queued result to arrive
JOIN_S = 5.0  # joining a finished rank at the end
JOIN_FAILED_S = 0.5  # ... after a failure (a rank still running is killed sooner)


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float,
    grace_s: float = WorldRunConfig().stop_grace_s,
    num_threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, init_method, *args)`` on ``world_size`` local processes.

    Args:
        timeout_s: wall-clock limit for the whole world (required: the caller's configured
            bound, e.g. ``generate_many_on_world``'s; no second default here).
        grace_s: after the first failure, how long the other ranks get to finish (they usually
            fail on their own collective timeout) before they are killed (default:
            ``WorldRunConfig.stop_grace_s``).
        num_threads: ``torch.set_num_threads`` in each rank (None leaves torch's default).
    Returns:
        ``fn``'s return values, in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    start_forkserver()
    init_method = f"tcp://127.0.0.1:{free_port(reserved=reserved_ports())}"
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, init_method, args, num_threads, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(world_size)) - set(outputs) - set(failures))
                failures.update({r: f"still running after timeout_s={timeout_s}" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=RESULT_TICK_S)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if proc.exitcode is not None and rank not in outputs and rank not in failures:
                        # give a just-finished rank's message a moment to arrive
                        try:
                            r, ok, value = results.get(timeout=LATE_RESULT_WAIT_S)
                            (outputs if ok else failures)[r] = value
                        except queue.Empty:
                            failures[rank] = f"process died with exit code {proc.exitcode}"
                continue
            (outputs if ok else failures)[rank] = value
            if failures:
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for proc in procs:
            proc.join(timeout=JOIN_FAILED_S if failures else JOIN_S)
            if proc.is_alive():
                logger.warning("killing local rank process %d", proc.pid)
                proc.kill()
                proc.join()
        results.close()
    if failures:
        details = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise LocalWorldError(f"local world of {world_size} failed on ranks {sorted(failures)}:\n{details}")
    return [outputs[r] for r in range(world_size)]
