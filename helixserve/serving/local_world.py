"""A worker's local world (a gen world's dp x cp ranks, a ctx world's tp ranks): this process is
rank 0 (its :class:`~helixserve.engine.spmd.driver.WorldDriver` goes to ``AsyncEngine``) and ranks
1..world-1 are spawned here as local processes, each running
:func:`~helixserve.engine.world_rank.run_rank` until rank 0 shuts the world down."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from helixserve.config import reserved_ports
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.world_rank import (ShardReceiverFactory, WorldOptions, check_fits_world, run_rank,
                                          start_rank0)
from helixserve.models.dummy import model_config_of
from helixserve.parallel import Mapping
from helixserve.parallel.forkserver import start_forkserver
from helixserve.parallel.ports import free_port

logger = logging.getLogger(__name__)


def _local_rank_main(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                     options: WorldOptions, kv_receiver_factory: ShardReceiverFactory | None) -> None:
    torch.set_num_threads(1)
    # a SIGTERM to the server's process group is rank 0's to handle: it sends the shutdown plan
    # (and if rank 0 dies instead, this rank's next collective fails and the process ends)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_rank(model_dir, Mapping(world_size, rank, dp=dp, cp=cp), init_method, options, kv_receiver_factory)


@dataclass(slots=True)
class LocalWorld:
    """Rank 0 (this process) and the spawned ranks of a one-machine world."""

    driver: WorldDriver
    processes: list[mp.process.BaseProcess]
    stop_grace_s: float  # WorldOptions.stop_grace_s: close()'s default

    def is_alive(self) -> bool:
        return self.driver.failure is None and all(p.is_alive() for p in self.processes)

    def close(self, grace_s: float | None = None) -> None:
        """Shut the ranks down (or kill them after ``grace_s``, default ``stop_grace_s``) and
        leave the process groups."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        try:
            self.driver.shutdown()
        except Exception as exc:  # noqa: BLE001 - the world is going away anyway
            logger.warning("world shutdown plan failed: %s", exc)
        for proc in self.processes:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                logger.warning("killing world rank process %d", proc.pid)
                proc.kill()
                proc.join()
        self.driver.groups.destroy()


def start_local_world(model_dir: str | Path, *, dp: int, cp: int, options: WorldOptions = WorldOptions(),
                      kv_receiver_factory: ShardReceiverFactory | None = None,
                      heartbeat_s: float | None = None, local_rank: int = 0,
                      driver_cls: type[WorldDriver] = WorldDriver) -> LocalWorld:
    """Make this process rank 0 of a dp x cp world whose other ranks are spawned here.

    ``local_rank``: rank 0's CUDA device index under NCCL (spawned rank r uses r).
    """
    model_dir = Path(model_dir)
    check_fits_world(model_config_of(model_dir, options.load_format), dp, cp)
    world_size = dp * cp
    init_method = f"tcp://127.0.0.1:{free_port(reserved=reserved_ports())}"
    ctx = mp.get_context("forkserver")
    start_forkserver()  # a SIGTERM to this worker's group leaves it (and so the ranks' exit status) alone
    processes = [
        ctx.Process(target=_local_rank_main, name=f"world-rank-{rank}", daemon=True,
                    args=(rank, world_size, init_method, str(model_dir), dp, cp, options, kv_receiver_factory))
        for rank in range(1, world_size)
    ]
    for proc in processes:
        proc.start()
    try:
        driver = start_rank0(model_dir, Mapping(world_size, 0, dp=dp, cp=cp), init_method, options,
                             kv_receiver_factory, heartbeat_s, local_rank, driver_cls)
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    return LocalWorld(driver, processes, options.stop_grace_s)
