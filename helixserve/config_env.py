"""The launcher variables of this process, parsed once (torch-free; owned by ``helixserve.config``).

Two launchers describe a process through its environment:

- SLURM's batch / step variables (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_SUBMIT_DIR``): :func:`slurm_env_from` -> :class:`SlurmEnv`, what the
  SLURM launcher (``helixserve.launch.slurm``) plans a job from.
- torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
  ``TORCHELASTIC_USE_AGENT_STORE``: its agent serves the rendezvous store, joined through torch's
  ``env://``, which reads those variables itself) or
  srun's per-task ones (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, with
  ``SLURM_JOB_NODELIST`` / ``SLURM_JOB_ID`` for a missing address): :func:`dist_env_from` ->
  :class:`DistEnv`, the world rank ``helixserve.parallel.groups.init_from_env`` joins with.

A launcher names every port of its deployment in ``HELIXSERVE_RESERVED_PORTS``
(:func:`reserved_ports_from`): its children each draw their own free ports
(``parallel.ports``), and one must not draw another's configured port before that one binds it.

The functions are pure (they take the mapping); :func:`helixserve.config.slurm_env` and
:func:`helixserve.config.dist_env` pass ``os.environ``. Launchers and ``parallel`` receive the
parsed values and read no variable themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_RDZV_PORT_BASE = 20000  # an srun world without MASTER_PORT rendezvous on base + job id % base
SINGLE_RANK_ADDR, SINGLE_RANK_PORT = "127.0.0.1", 29500  # a world of one without MASTER_*
RESERVED_PORTS_ENV = "HELIXSERVE_RESERVED_PORTS"


def reserved_ports_from(environ: Mapping[str, str]) -> frozenset[int]:
    """The ports ``HELIXSERVE_RESERVED_PORTS`` (comma-separated) names; a malformed entry is a
    ``ValueError`` naming it, never a silent empty set."""
    raw = environ.get(RESERVED_PORTS_ENV, "")
    out = set()
    for item in filter(None, (x.strip() for x in raw.split(","))):
        if not item.isdigit() or not 0 < int(item) < 65536:
            raise ValueError(f"{RESERVED_PORTS_ENV}={raw!r}: {item!r} is not a TCP port")
        out.add(int(item))
    return frozenset(out)


def with_reserved_ports(environ: Mapping[str, str], ports: set[int] | frozenset[int]) -> dict[str, str]:
    """``environ`` with ``ports`` added to the ones it already reserves."""
    merged = reserved_ports_from(environ) | set(ports)
    return {**environ, RESERVED_PORTS_ENV: ",".join(str(p) for p in sorted(merged))}


@dataclass(frozen=True, slots=True)
class SlurmEnv:
    """The allocation this process runs in, as SLURM's variables describe it."""

    job_id: str
    nodelist: str
    procid: int = 0
    ntasks: int = 1
    submit_dir: str | None = None


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Rank and rendezvous address as a launcher (torchrun or srun) describes them."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm"
    # torchrun's agent already serves the rendezvous store on MASTER_PORT
    # (TORCHELASTIC_USE_AGENT_STORE=True): every rank joins it, rank 0 too, through torch's env://
    agent_store: bool = False

    @property
    def init_method(self) -> str:
        return "env://" if self.agent_store else f"tcp://{self.master_addr}:{self.master_port}"


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _job_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")


def _nodelist(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")


def slurm_env_from(environ: Mapping[str, str]) -> SlurmEnv:
    """Parse ``SLURM_*`` variables.

    Raises:
        ValueError: not inside a SLURM job, or a variable is malformed.
    """
    job_id, nodelist = _job_id(environ), _nodelist(environ)
    if not job_id or not nodelist:
        raise ValueError("not inside a SLURM job (SLURM_JOB_ID / SLURM_JOB_NODELIST unset); "
                         "submit with `sbatch deploy/slurm/helixserve.sbatch` or run under salloc")
    try:
        procid = int(environ.get("SLURM_PROCID", "0"))
        ntasks = int(environ.get("SLURM_NTASKS") or "1")  # unset when sbatch got no -n
    except ValueError:
        raise ValueError(f"SLURM_PROCID={environ.get('SLURM_PROCID')!r} / SLURM_NTASKS="
                         f"{environ.get('SLURM_NTASKS')!r} must be integers") from None
    if not 0 <= procid < ntasks:
        raise ValueError(f"SLURM_PROCID={procid} is outside [0, SLURM_NTASKS={ntasks})")
    return SlurmEnv(job_id, nodelist, procid, ntasks, environ.get("SLURM_SUBMIT_DIR"))


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,9],cpu1" -> "gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, first = match.group(1), match.group(2)
    return prefix + (first or "")


def dist_env_from(environ: Mapping[str, str]) -> DistEnv | None:
    """Parse torchrun or srun variables from ``environ``; ``None`` when neither launched us.

    torchrun wins when both are present (torchrun inside an srun allocation).

    Raises:
        ValueError: a variable is not an integer, rank is outside the world, or the
            rendezvous address cannot be determined.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        launcher, rank_var, world_var, local_var = "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        launcher, rank_var, world_var, local_var = "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    else:
        return None
    rank, world_size = _int_var(environ, rank_var), _int_var(environ, world_var)
    local_rank = _int_var(environ, local_var) if local_var in environ else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{rank_var}={rank} is outside [0, {world_var}={world_size})")

    nodelist = _nodelist(environ)
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif launcher == "slurm" and nodelist:
        addr = first_slurm_host(nodelist)
    elif world_size == 1:
        addr = SINGLE_RANK_ADDR
    else:
        raise ValueError(f"{launcher} world of {world_size} ranks but MASTER_ADDR is not set")
    if "MASTER_PORT" in environ:
        port = _int_var(environ, "MASTER_PORT")
    elif launcher == "slurm" and "SLURM_JOB_ID" in environ:
        port = SLURM_RDZV_PORT_BASE + _int_var(environ, "SLURM_JOB_ID") % SLURM_RDZV_PORT_BASE
    elif world_size == 1:
        port = SINGLE_RANK_PORT
    else:
        raise ValueError(f"{launcher} world of {world_size} ranks but MASTER_PORT is not set")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a valid TCP port")
    agent_store = launcher == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return DistEnv(rank, world_size, local_rank, addr, port, launcher, agent_store)
