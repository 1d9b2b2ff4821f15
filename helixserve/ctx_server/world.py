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

It serves plain (aggregated) requests, prefill and decode through the world, its warm-up
(``/ready``), and ``context_only`` requests the way a ctx worker of one rank does
(:mod:`.context_only`): every rank's KV sender serves its own shard (:mod:`.world_transfer`), on
``transceiver_port + rank``, and the answer names them all (``ctx_endpoints``).
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.ctx_server.context_only import ContextOnlyHandler, abort_offered, install_release
from helixserve.ctx_server.ctx_requests import CtxRequests
from helixserve.ctx_server.world_transfer import CtxWorldTransceiver, WorldSenderFactory
from helixserve.engine.world_rank import WorldOptions
from helixserve.models.dummy import tokenizer_of
from helixserve.parallel import DistEnv
from helixserve.protocol import RequestType
from helixserve.serving.loading import kv_layout, wrap_core
from helixserve.serving.prefix_events import install_prefix_events
from helixserve.serving.prefix_metrics import PrefixCacheCollector
from helixserve.serving.warm_up import WarmUp
from helixserve.serving.worker_app import aggregated_handler, build_worker_app
from helixserve.serving.world_core import WorldCore, serve_world_rank, start_served_world, world_options
from helixserve.serving.world_supervisor import RankCacheCollector

logger = logging.getLogger(__name__)


def ctx_world_options(deploy: DeploymentConfig, server: CtxServerConfig) -> WorldOptions:
    """The world's options, each rank's KV sender included (every rank builds the same)."""
    factory = WorldSenderFactory(deploy.transceiver, str(deploy.model.path), deploy.model.load_format,
                                 deploy.model.name, deploy.model.dtype, server.tp, server.transceiver_host,
                                 server.transceiver_port, server.pickup_timeout_s)
    return dataclasses.replace(world_options(deploy, server), kv_sender=factory)


def run_ctx_rank(deploy: DeploymentConfig, server: CtxServerConfig, env: DistEnv) -> int:
    """A task != 0 of an srun / torchrun ctx world: serves rank 0's plans, no HTTP; the steps run."""
    return serve_world_rank(deploy, "ctx", 1, server.tp, ctx_world_options(deploy, server), None, env)


def build_ctx_world_app(deploy: DeploymentConfig, server: CtxServerConfig, env: DistEnv | None = None) -> FastAPI:
    """Start the ctx world (this process rank 0: of the srun / torchrun world ``env`` describes,
    else of one whose other ranks are spawned here) and build its app; the world is shut down
    after the engine thread stops."""
    world = start_served_world(deploy, server, "ctx", 1, server.tp, ctx_world_options(deploy, server), None, env)
    try:
        core = world.driver.core
        tokenizer = tokenizer_of(deploy.model.path, deploy.model.load_format)
        layout = kv_layout(core, core.model_config, deploy.model.name).model_copy(update={"ctx_tp_size": server.tp})
        worker = wrap_core("ctx", deploy, WorldCore(world), tokenizer, core.model_config, layout,
                           core.scheduler.max_model_len, server.max_queue_len)
    except BaseException:
        world.close()
        raise
    requests = CtxRequests(worker.engine, server.pickup_timeout_s)
    transceiver = CtxWorldTransceiver(requests, world, server)
    worker.failure = world.failure
    worker.extra_stats = lambda: {"world": world.describe(), **transceiver.stats()}
    worker.extra_gauges = lambda: [*requests.gauges(), *transceiver.gauges()]
    worker.abort_override = abort_offered(requests, transceiver)
    worker.warm_up = WarmUp.for_deployment("ctx", deploy, server.warm_up, server.warm_up_timeout_s)
    handlers = {None: aggregated_handler(worker),
                RequestType.CONTEXT_ONLY: ContextOnlyHandler(worker, requests, transceiver)}
    worker.registry.register(RankCacheCollector(worker.role, world))
    if deploy.cache.prefix_caching:
        worker.registry.register(PrefixCacheCollector(lambda: world.driver.prefix_stats, {"role": worker.role}))
    app = build_worker_app(worker, handlers, lifespan_hooks=(requests.running, transceiver.running),
                           after_shutdown=(world.close,))
    if deploy.cache.prefix_caching:  # the router's index: the CP group's blocks, of the world running now
        install_prefix_events(app, lambda: world.driver.core.cache_manager.events, deploy.cache.tokens_per_block)
    install_release(app, requests, transceiver)
    app.state.world = world
    app.state.requests = requests
    app.state.transceiver = transceiver
    logger.info("ctx worker drives a tp=%d world (helix layout dp 1 x cp %d, ep %d), KV senders on %s",
                server.tp, server.tp, server.ep, [f"{h}:{p}" for h, p in server.transceiver_endpoints])
    return app
