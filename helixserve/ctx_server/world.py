"""A ctx worker of ``tp > 1`` ranks: the world every role runs (:mod:`helixserve.serving.world_core`),
laid out as the gen world's helix layout dp 1 x cp tp: KDA heads and MLA value heads
tensor-parallel over the ranks, MLA latent pages dealt round-robin (global block b on rank
b % tp), experts over every rank (ep = tp). This process is rank 0: it spawns ranks 1 .. tp-1,
runs the scheduler and the HTTP server; a failed world is restarted under ``ctx[].world_restart``.

Under ``srun -n tp`` (the SLURM launcher's ctx step) or torchrun, every task runs
``helixserve serve-ctx``: task 0 is rank 0 and serves HTTP, every other task runs
:func:`run_ctx_rank` (joins, loads its shard, runs plans until rank 0 shuts the world down); such
a world is not restarted in place: when it fails the worker exits non-zero, for srun / SLURM to
restart the step.

What it serves today: plain (aggregated) requests, prefill and decode through the world, and its
warm-up (``/ready``). ``context_only`` requests need the KV sender to read every rank's shard,
which it cannot yet: the worker refuses to start in a deployment whose gen workers take their KV
from ctx workers (``kv_source: ucx``), and a ``context_only`` request is refused with a 400
``ctx_world_transfer_unavailable`` naming ``tp``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.models.dummy import tokenizer_of
from helixserve.parallel import DistEnv
from helixserve.protocol import InvalidRequestError, RequestType
from helixserve.serving.loading import kv_layout, wrap_core
from helixserve.serving.openai_serving import PreparedRequest
from helixserve.serving.warm_up import WarmUp
from helixserve.serving.worker_app import aggregated_handler, build_worker_app
from helixserve.serving.world_core import WorldCore, serve_world_rank, start_served_world, world_options
from helixserve.serving.world_supervisor import RankCacheCollector

logger = logging.getLogger(__name__)


class CtxWorldTransferUnavailableError(ValueError):
    """A ctx world of more than one rank in a deployment whose gen workers pull KV from it."""


def transfers_unavailable(server: CtxServerConfig) -> str:
    return (f"KV transfers from a ctx world of more than one rank are not available yet "
            f"(ctx worker {server.url} has tp={server.tp})")


def check_ctx_world(deploy: DeploymentConfig, server: CtxServerConfig) -> None:
    """Refuse a ctx world that gen workers would pull KV from (named), before any rank starts."""
    pulling = [g.url for g in deploy.gen if g.kv_source == "ucx"]
    if server.tp > 1 and pulling:
        raise CtxWorldTransferUnavailableError(
            f"{transfers_unavailable(server)}, and gen workers {pulling} take their KV from ctx workers "
            "(kv_source: ucx): run this ctx worker with tp: 1, or those gen workers with kv_source: recompute")


class ContextOnlyRefused:
    """``context_only`` on a ctx world: a 400 naming tp (no rank's shard can be sent yet)."""

    def __init__(self, server: CtxServerConfig) -> None:
        self.message = f"this ctx worker cannot serve context_only requests: {transfers_unavailable(server)}"

    async def __call__(self, http_request: Request, prepared: PreparedRequest) -> Response:
        raise InvalidRequestError(self.message, param="disaggregated_params.request_type",
                                  code="ctx_world_transfer_unavailable")


def run_ctx_rank(deploy: DeploymentConfig, server: CtxServerConfig, env: DistEnv) -> int:
    """A task != 0 of an srun / torchrun ctx world: serves rank 0's plans, no HTTP; the steps run."""
    check_ctx_world(deploy, server)
    return serve_world_rank(deploy, "ctx", 1, server.tp, world_options(deploy, server), None, env)


def build_ctx_world_app(deploy: DeploymentConfig, server: CtxServerConfig, env: DistEnv | None = None) -> FastAPI:
    """Start the ctx world (this process rank 0: of the srun / torchrun world ``env`` describes,
    else of one whose other ranks are spawned here) and build its app; the world is shut down
    after the engine thread stops."""
    check_ctx_world(deploy, server)
    world = start_served_world(deploy, server, "ctx", 1, server.tp, world_options(deploy, server), None, env)
    try:
        core = world.driver.core
        tokenizer = tokenizer_of(deploy.model.path, deploy.model.load_format)
        worker = wrap_core("ctx", deploy, WorldCore(world), tokenizer, core.model_config,
                           kv_layout(core, core.model_config, deploy.model.name),
                           core.scheduler.max_model_len, server.max_queue_len)
    except BaseException:
        world.close()
        raise
    worker.failure = world.failure
    worker.extra_stats = lambda: {"world": world.describe()}
    worker.warm_up = WarmUp.for_deployment("ctx", deploy, server.warm_up, server.warm_up_timeout_s)
    handlers = {None: aggregated_handler(worker), RequestType.CONTEXT_ONLY: ContextOnlyRefused(server)}
    worker.registry.register(RankCacheCollector(worker.role, world))
    app = build_worker_app(worker, handlers, after_shutdown=(world.close,))
    app.state.world = world
    logger.info("ctx worker drives a tp=%d world (helix layout dp 1 x cp %d, ep %d)", server.tp, server.tp, server.ep)
    return app
