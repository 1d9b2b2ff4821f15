"""A worker's engine when it drives an SPMD world: a gen world (dp x cp ranks) or a ctx world
(tp ranks, the helix layout dp 1 x cp tp), both the same :class:`~helixserve.engine.spmd.driver.WorldDriver`.

Where the ranks come from:

- by default this server process is rank 0 and spawns the other ranks on this machine
  (:func:`~helixserve.serving.local_world.start_local_world`: gloo on CPU, one GPU per rank under
  NCCL);
- under ``srun`` / torchrun every task runs the server command (``serve-gen`` / ``serve-ctx``):
  task 0 is rank 0 and serves HTTP, every other task joins (:func:`serve_world_rank`) and serves
  plans until rank 0 shuts the world down.

:class:`WorldCore` is rank 0's driver as the ``AsyncEngine``'s core, plus the world's liveness:
a spawned rank that died, or a world that stopped (a collective failed or timed out), makes
:meth:`~.world_supervisor.ServedWorld.failure` name the cause; the worker's ``/health`` then
answers 503 with it, new requests fail with a 503 naming it, and requests in flight fail at the
next world step with a 503 ``<role>_world_failed``. Then the world is restarted in place under
the worker's ``world_restart`` (:mod:`.world_supervisor`), or, past that policy or under srun /
torchrun, the worker exits non-zero.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from helixserve.config import DeploymentConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.core import EngineStats
from helixserve.engine.errors import (EngineError, EngineUnavailableError, KVTransferError,
                                      KVTransferTimeoutError)
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spmd.driver import WorldDriver, drive_to_completion
from helixserve.engine.spmd.messages import WorldStoppedError
from helixserve.engine.world_rank import ShardReceiverFactory, WorldOptions, run_rank, start_rank0
from helixserve.serving.local_world import LocalWorld, start_local_world
from helixserve.parallel import DistEnv, Mapping
from helixserve.serving.warm_up import warm_up_prompts
from helixserve.serving.world_supervisor import ServedWorld, WorldSettings, WorldSupervisor
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class WorldServerSettings(WorldSettings, Protocol):
    """What a world worker's config gives (``GenServerConfig``, ``CtxServerConfig``)."""

    @property
    def device(self) -> str | None: ...
    @property
    def collective_timeout_s(self) -> float: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def speculative(self) -> SpeculativeConfig | None: ...


def world_options(deploy: DeploymentConfig, server: WorldServerSettings) -> WorldOptions:
    device = server.device or deploy.model.device
    return WorldOptions(cache=deploy.cache, scheduler=deploy.scheduler, dtype=deploy.model.dtype,
                        experts=deploy.model.experts, use_cuda_graphs=not deploy.model.enforce_eager,
                        load_format=deploy.model.load_format, deterministic=deploy.model.deterministic,
                        seed=deploy.seed, timeout_s=server.collective_timeout_s,
                        stop_grace_s=server.world_stop_grace_s,
                        backend="gloo" if device == "cpu" else None, speculative=server.speculative)


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


class WorldCore:
    """The world's rank-0 driver as an ``EngineCoreLike`` (engine thread only), refusing work with
    a 503 ``<role>_world_failed`` naming the cause once the world failed, and explaining failed
    transfers (:meth:`failure_error`).

    When the world fails (a rank died, a collective failed), every request in it, or waiting
    here, ends with that 503 at the next step (its reader, streamed or not, gets the error) and
    the world's gauges read zero until the supervisor's restarted world is swapped in, between
    two steps.

    Received requests wait in their CP group's KV intake (FIFO) until their shard's blocks and
    state slot fit in the group's cache (:mod:`helixserve.engine.kv_intake`).
    """

    def __init__(self, world: ServedWorld) -> None:
        self.world = world
        self.code = f"{world.role}_world_failed"
        self._failed: dict[str, str] = {}  # in the failed world, not yet told -> the error message
        self._world_errors: dict[str, str] = {}  # told, until failure_error() asks

    @property
    def driver(self) -> WorldDriver:
        """The current world's driver (a restart replaces it)."""
        return self.world.driver

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    hold_cache: bool = False, forced_output_token_ids: Sequence[int] = (),
                    kv_ticket: KVTicket | None = None) -> None:
        self._supervise()
        cause = self.world.failure()
        if cause is not None:
            raise EngineUnavailableError(f"{self.world.role} worker cannot serve: {cause}", code=self.code)
        self._add(request_id, prompt_token_ids, params, hold_cache=hold_cache,
                  forced_output_token_ids=forced_output_token_ids, kv_ticket=kv_ticket)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any) -> None:
        try:
            self.driver.add_request(request_id, prompt_token_ids, params, **kwargs)
        except WorldStoppedError as exc:
            raise EngineUnavailableError(str(exc), code=self.code) from None

    def abort(self, request_id: str, error: str | None = None) -> bool:
        return self.driver.abort(request_id, error)

    def release(self, request_id: str) -> bool:
        return self.driver.release(request_id)

    def abort_all(self, error: str) -> list[str]:
        return self.driver.abort_all(error)

    def has_unfinished_requests(self) -> bool:
        self._supervise()
        if self._failed:
            return True  # step() tells their readers
        if self.world.failure() is not None:
            return False
        return self.driver.has_unfinished_requests()

    def step(self) -> list[RequestUpdate]:
        self._supervise()
        if self._failed or self.world.failure() is not None:
            return self._failed_updates()
        try:
            return self.driver.step()
        except WorldStoppedError:
            self._supervise()  # the driver's failure is the world's now
            return self._failed_updates()

    def _supervise(self) -> None:
        """Swap in a restarted world; notice a failed one (its requests fail, its restart begins)."""
        if self.world.take_restarted():
            logger.warning("%s world restarted: serving again", self.world.role)
        cause = self.world.notice_failure()
        if cause is None:
            return
        message = f"the {self.world.role} world failed while this request was in it: {cause}"
        failed = self.driver.abort_all(message)
        self._failed.update(dict.fromkeys(failed, message))

    def _failed_updates(self) -> list[RequestUpdate]:
        updates = [RequestUpdate(rid, -1, RequestStatus.FINISHED_ERROR) for rid in self._failed]
        self._world_errors.update(self._failed)
        self._failed = {}
        return updates

    def stats(self) -> EngineStats:
        """The world's totals; all zero while it is failed (its ranks' caches are gone)."""
        if self.world.failure() is not None:
            return EngineStats(0, 0, 0, 0, 0, 0, 0)
        return self.driver.stats()

    def failure_error(self, request_id: str) -> EngineError | None:
        world_error = self._world_errors.pop(request_id, None)
        if world_error is not None:
            return EngineUnavailableError(world_error, code=self.code)
        cause = self.driver.kv_failure(request_id)
        if cause is None:
            return None
        if "timed out" in cause or "deadline" in cause.lower():
            return KVTransferTimeoutError(cause)
        return KVTransferError(cause)


def check_env(env: DistEnv, role: str, dp: int, cp: int) -> None:
    if env.world_size != dp * cp:
        raise ValueError(f"{env.launcher} started {env.world_size} tasks for a {role} world of dp={dp} "
                         f"x cp={cp} = {dp * cp} ranks")


def serve_world_rank(deploy: DeploymentConfig, role: str, dp: int, cp: int, options: WorldOptions,
                     kv_receiver_factory: ShardReceiverFactory | None, env: DistEnv) -> int:
    """A task != 0 of an srun / torchrun ``dp x cp`` world: join, serve plans until rank 0 shuts
    the world down; the steps run (raises when the world fails, so the task ends and srun notices)."""
    check_env(env, role, dp, cp)
    mapping = Mapping(env.world_size, env.rank, dp=dp, cp=cp)
    logger.info("%s world rank %d/%d joining at %s", role, env.rank, env.world_size, env.init_method)
    return run_rank(deploy.model.path, mapping, env.init_method, options, kv_receiver_factory,
                    local_rank=env.local_rank)


def start_served_world(deploy: DeploymentConfig, server: WorldServerSettings, role: str, dp: int, cp: int,
                       options: WorldOptions, kv_receiver_factory: ShardReceiverFactory | None,
                       env: DistEnv | None = None) -> ServedWorld:
    """This process as rank 0 of a ``dp x cp`` world: of the srun / torchrun world ``env``
    describes when it has more than one rank, else of a world whose other ranks are spawned
    here (restarted under ``server.world_restart`` when it fails)."""
    model_dir = Path(deploy.model.path)
    if env is not None and env.world_size > 1:
        check_env(env, role, dp, cp)
        mapping = Mapping(env.world_size, env.rank, dp=dp, cp=cp)
        driver = start_rank0(model_dir, mapping, env.init_method, options, kv_receiver_factory, server.heartbeat_s,
                             env.local_rank, WorldDriver)
        return ServedWorld(driver, None, WorldSupervisor(server, None, role))  # cannot restart
    device = server.device or deploy.model.device
    local_rank = _device_index(device) if dp * cp == 1 else 0

    def start() -> LocalWorld:
        return start_local_world(model_dir, dp=dp, cp=cp, options=options,
                                 kv_receiver_factory=kv_receiver_factory, heartbeat_s=server.heartbeat_s,
                                 local_rank=local_rank, driver_cls=WorldDriver)

    def restart() -> LocalWorld:  # warmed up: healthy again means serving at full speed again
        local = start()
        try:
            warm_up_world(local.driver, deploy, role)
        except BaseException:
            local.driver.failure = local.driver.failure or "its warm-up failed"
            local.close(grace_s=server.failed_world_grace_s)
            raise
        return local

    local = start()
    return ServedWorld(local.driver, local, WorldSupervisor(server, restart, role))


def warm_up_world(driver: WorldDriver, deploy: DeploymentConfig, role: str) -> None:
    """A restarted world's warm-up, the requests a worker's first warm-up sends
    (:mod:`helixserve.serving.warm_up`), one per DP group, through every rank (the first forward
    of a fresh world is slow); it frees everything it allocated. Raises if one failed."""
    core = driver.core
    max_len = core.scheduler.max_model_len
    prompts = warm_up_prompts(max_len, min(deploy.limits.max_prompt_tokens or max_len, max_len),
                              core.model_config.vocab_size, deploy.cache.tokens_per_block,
                              max(deploy.scheduler.max_num_batched_tokens, deploy.cache.max_num_seqs))
    num_groups = driver.mapping.dp
    for prompt, params, copies in prompts:
        results = drive_to_completion(driver, [prompt] * (num_groups * copies), [params] * (num_groups * copies))
        failed = [f"{r.request_id}: {r.error or r.finish_reason}" for r in results
                  if r.finish_reason in ("error", "abort")]
        if failed:
            raise RuntimeError(f"the restarted {role} world's warm-up failed: {'; '.join(failed)}")
