"""Process-group setup for a generation world (gloo on CPU, NCCL on CUDA).

Launch paths:

- torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
- srun: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the address comes from
  ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else the first host of ``SLURM_JOB_NODELIST`` and
  a port derived from ``SLURM_JOB_ID``.
- explicit: ``init_parallel(mapping, "tcp://host:port")`` (local spawned worlds, tests).

Every listener binds the rendezvous host: rank 0's TCPStore listens on ``host`` of
``tcp://host:port`` only (:func:`tcp_store`); gloo's pairs listen on the address the host
resolves to. This module reads no environment variables: ``helixserve.config.dist_env`` parses
them once (:mod:`helixserve.config_env`, re-exported here) and callers pass the :class:`DistEnv`.
Every process group gets a timeout, so a missing or dead peer makes a collective raise instead
of hanging (NCCL honours it through its async error handling); it has no default here: the
caller passes its configured value (``GenServerConfig.collective_timeout_s``, ``WorldOptions``).
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from helixserve.config_env import DistEnv, dist_env_from, first_slurm_host
from helixserve.parallel.collectives import set_nccl_blocking_wait
from helixserve.parallel.mapping import Mapping

logger = logging.getLogger(__name__)

__all__ = ["DistEnv", "ParallelGroups", "dist_env_from", "first_slurm_host", "init_from_env", "init_parallel",
           "tcp_store"]


def tcp_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of a ``tcp://host:port`` world, listening on ``host`` only (None for
    other schemes). torch's own ``tcp://`` rendezvous makes rank 0's TCPStore listen on every
    interface (``::``) whatever the host; here rank 0 binds the socket itself and hands it over
    (``master_listen_fd``; the store owns and closes it)."""
    parsed = urlsplit(init_method)
    if parsed.scheme != "tcp":
        return None
    host, port = parsed.hostname, parsed.port
    if not host or port is None:
        raise ValueError(f"init_method {init_method!r} must be tcp://host:port")
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=max(128, world_size))
    except OSError as exc:
        raise RuntimeError(f"rank 0 cannot listen for its world on {host}:{port}: {exc}") from exc
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())


@dataclass(slots=True)
class ParallelGroups:
    """The process groups of one rank.

    Attributes:
        mapping: this rank's place in the world.
        backend: ``"gloo"`` or ``"nccl"``.
        device: where collective tensors must live (``cpu`` for gloo, ``cuda:LOCAL_RANK`` for nccl).
        world: the default group (all ranks).
        cp: this rank's CP group (ranks sharing requests; helix attention, row slicing).
        dp: this rank's DP group (same cp_rank across CP groups).
        ep: the expert-parallel group (= ``world``).
        cpu: a gloo group over all ranks for host-side control messages (= ``world`` on gloo).
        cp_cpu: a gloo group over this rank's CP group, for its leader's step messages and the
            transfer consensus (= ``cp`` on gloo).
        leaders_cpu: a gloo group of the CP leaders (``cp_rank == 0``), for rank 0's step plans
            and the leaders' reports; ``None`` on the other ranks.
        timeout: the timeout every group was created with.
    """

    mapping: Mapping
    backend: str
    device: torch.device
    world: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    cpu: dist.ProcessGroup
    cp_cpu: dist.ProcessGroup
    leaders_cpu: dist.ProcessGroup | None
    timeout: datetime.timedelta

    def destroy(self) -> None:
        """Tear down every group of this process (idempotent)."""
        set_nccl_blocking_wait(None)
        if dist.is_initialized():
            dist.destroy_process_group()
            logger.debug("rank %d: process groups destroyed", self.mapping.rank)


def _new_groups(all_ranks: list[list[int]], mine: list[int], backend: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Create every group in ``all_ranks`` (all ranks must call this in the same order)."""
    own = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if ranks == mine:
            own = group
    assert own is not None, f"rank list {mine} is not among {all_ranks}"
    return own


def init_parallel(
    mapping: Mapping,
    init_method: str,
    *,
    backend: str | None = None,
    local_rank: int = 0,
    timeout_s: float,
    nccl_blocking_wait: bool = True,
) -> ParallelGroups:
    """Join the world and create the CP and DP subgroups.

    Args:
        mapping: this rank's mapping; its ``world_size`` and ``rank`` are used for rendezvous.
        init_method: ``tcp://host:port`` (``DistEnv.init_method``) or ``file://...``.
        backend: ``"gloo"`` / ``"nccl"``; default nccl when CUDA is available, else gloo.
        local_rank: CUDA device index for nccl.
        timeout_s: timeout of every collective on every group.
        nccl_blocking_wait: on nccl, make the host wait for each collective of
            ``helixserve.parallel.collectives`` with ``timeout_s`` and raise on expiry (see that
            module); False trades that bound for CPU run-ahead, leaving hangs to NCCL's watchdog.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    set_nccl_blocking_wait(timeout if backend == "nccl" and nccl_blocking_wait else None)
    store = tcp_store(init_method, mapping.rank, mapping.world_size, timeout)
    dist.init_process_group(
        backend,
        init_method=None if store is not None else init_method,
        store=store,
        rank=mapping.rank,
        world_size=mapping.world_size,
        timeout=timeout,
    )
    world = dist.group.WORLD
    assert world is not None
    cp = _new_groups(mapping.all_cp_groups(), mapping.cp_group_ranks, backend, timeout)
    dp = _new_groups(mapping.all_dp_groups(), mapping.dp_group_ranks, backend, timeout)
    cpu = world if backend == "gloo" else dist.new_group(timeout=timeout, backend="gloo")
    cp_cpu = cp if backend == "gloo" else _new_groups(mapping.all_cp_groups(), mapping.cp_group_ranks, "gloo", timeout)
    leaders = [group[0] for group in mapping.all_cp_groups()]
    leaders_group = dist.new_group(leaders, timeout=timeout, backend="gloo")
    leaders_cpu = leaders_group if mapping.rank in leaders else None
    logger.info(
        "rank %d/%d joined %s world (dp=%d cp=%d): cp group %s, dp group %s",
        mapping.rank, mapping.world_size, backend, mapping.dp, mapping.cp,
        mapping.cp_group_ranks, mapping.dp_group_ranks,
    )
    return ParallelGroups(mapping, backend, device, world, cp, dp, world, cpu, cp_cpu, leaders_cpu, timeout)


def init_from_env(
    env: DistEnv,
    mapping: Mapping,
    *,
    backend: str | None = None,
    timeout_s: float,
    nccl_blocking_wait: bool = True,
) -> ParallelGroups:
    """:func:`init_parallel` for a launcher-described rank; checks it agrees with ``mapping``."""
    if (env.rank, env.world_size) != (mapping.rank, mapping.world_size):
        raise ValueError(
            f"{env.launcher} says rank={env.rank} world_size={env.world_size} but the mapping says "
            f"rank={mapping.rank} world_size={mapping.world_size}"
        )
    return init_parallel(
        mapping,
        env.init_method,
        backend=backend,
        local_rank=env.local_rank,
        timeout_s=timeout_s,
        nccl_blocking_wait=nccl_blocking_wait,
    )
