"""Configuration of process lifecycles: restarts, an offline gen world's waits, how a server
stops, and the launchers' waits. Part of :mod:`helixserve.config` (which re-exports every name);
torch-free, imports nothing of the package.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """Base of every config model: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RestartPolicy(Strict):
    """Bounded restarts of something that died: at most ``max_restarts`` within any
    ``window_s`` seconds, the k-th of them after ``backoff_s * 2**(k-1)`` s (at most
    ``max_backoff_s``); one more failure inside the window gives up (the owner exits non-zero)."""

    max_restarts: int = Field(3, ge=0)
    window_s: float = Field(300.0, gt=0)
    backoff_s: float = Field(1.0, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)


class WorldRunConfig(Strict):
    """An offline gen world's waits (``generate_many_on_world``, ``helixserve generate --dp --cp``,
    ``start_local_world`` outside a server): the defaults of the engine's ``WorldOptions``; a gen
    worker's world takes ``gen[].collective_timeout_s`` / ``world_stop_grace_s`` instead."""

    collective_timeout_s: float = Field(120.0, gt=0, description="a world collective waiting longer fails")
    run_timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one offline world run")
    stop_grace_s: float = Field(10.0, gt=0, description=(
        "spawned ranks get this long to exit (after the shutdown plan or a rank's failure), then SIGKILL"))


class ShutdownConfig(Strict):
    """How a server (ctx, gen, router) stops on SIGTERM: uvicorn lets open connections finish
    for ``connections_grace_s``; a worker's engine then lets requests still running finish for
    ``requests_grace_s`` and fails the rest. ``helixserve launch`` SIGKILLs after
    ``launch.stop_grace_s``: keep the sum below it."""

    connections_grace_s: float = Field(10.0, gt=0, description="uvicorn's graceful shutdown: open connections")
    requests_grace_s: float = Field(5.0, gt=0, description="then requests still running in a worker's engine")


class SlurmJobConfig(Strict):
    """``python -m helixserve.launch.slurm`` (``--ready-timeout`` / ``--grace`` override these)."""

    ready_timeout_s: float = Field(600.0, gt=0)  # the router's /ready, from the first srun step
    stop_grace_s: float = Field(20.0, ge=0)  # between SIGTERM to every step and SIGKILL
    scontrol_timeout_s: float = Field(30.0, gt=0, description="one scontrol call (show hostnames)")


class LaunchConfig(Strict):
    """``helixserve launch``: a child process (worker or router) that exits is started again
    under ``restart`` (``restart_children: false``: the first exit stops the deployment); one
    that exits more often than the policy allows stops it with a non-zero exit code.

    The launchers' waits live here (and nowhere else): ``ready_timeout_s`` for the router's
    ``/ready`` (``helixserve launch --ready-timeout`` overrides it), ``stop_grace_s`` between
    SIGTERM and SIGKILL when it stops its children, ``ready_probe_timeout_s`` for one ``/ready``
    probe; ``slurm`` for the SLURM launcher."""

    restart_children: bool = True
    restart: RestartPolicy = RestartPolicy(max_restarts=5)
    ready_timeout_s: float = Field(180.0, gt=0)
    stop_grace_s: float = Field(15.0, ge=0)
    ready_probe_timeout_s: float = Field(2.0, gt=0)
    slurm: SlurmJobConfig = SlurmJobConfig()
