"""The ctx worker's app: ``context_only`` requests (stages in the package docstring;
:mod:`.context_only`), plain requests aggregated, the KV sender (:mod:`.transfer`) and
``POST /v1/release`` for holds."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.ctx_server.context_only import ContextOnlyHandler, abort_offered, install_release
from helixserve.ctx_server.ctx_requests import CtxRequests
from helixserve.ctx_server.transfer import CtxTransceiver
from helixserve.ctx_server.world import build_ctx_world_app
from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager
from helixserve.parallel import DistEnv
from helixserve.protocol import RequestType
from helixserve.serving.loading import make_worker
from helixserve.serving.prefix_events import install_prefix_events
from helixserve.serving.warm_up import WarmUp
from helixserve.serving.worker_app import aggregated_handler, build_worker_app

logger = logging.getLogger(__name__)


def build_ctx_app(deploy: DeploymentConfig, server: CtxServerConfig, env: DistEnv | None = None) -> FastAPI:
    """Load the engine and build the app (the engine thread, then the KV sender, start with it);
    ``server.tp > 1``: a ctx world (:mod:`.world`; ``env``: the srun / torchrun rank 0, when a
    launcher started the other ranks)."""
    if server.tp > 1:
        return build_ctx_world_app(deploy, server, env)
    worker, core = make_worker("ctx", deploy, server.max_queue_len, server.device, server.speculative)
    requests = CtxRequests(worker.engine, server.pickup_timeout_s)
    transceiver = CtxTransceiver(requests, core, worker.layout, deploy.transceiver, server)
    worker.extra_gauges = lambda: [
        *requests.gauges(num_expired_by_sender=int(transceiver.stats()["kv_pickups_expired"])),
        *transceiver.gauges()]
    worker.extra_stats = transceiver.stats

    worker.abort_override = abort_offered(requests, transceiver)
    # a context_only prefill's way: held at its finish, then released (as a gen worker's fetch would)
    worker.warm_up = WarmUp.for_deployment("ctx", deploy, server.warm_up, server.warm_up_timeout_s,
                                           hold_cache=True)
    handlers = {
        None: aggregated_handler(worker),
        RequestType.CONTEXT_ONLY: ContextOnlyHandler(worker, requests, transceiver),
    }
    app = build_worker_app(worker, handlers, lifespan_hooks=(requests.running, transceiver.running))
    cache = core.cache_manager
    if isinstance(cache, PrefixCachingCacheManager) and cache.events is not None:
        log = cache.events
        install_prefix_events(app, lambda: log, cache.tokens_per_block)  # the router's index

    install_release(app, requests, transceiver)
    app.state.requests = requests
    app.state.transceiver = transceiver
    return app
