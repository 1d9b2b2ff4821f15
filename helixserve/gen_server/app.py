"""The gen worker's app: ``generation_only`` requests through a :class:`KVSource` (stages in the
package docstring) and plain requests aggregated."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from helixserve.config import DeploymentConfig, GenServerConfig
from helixserve.engine.output_stream import RequestOutput
from helixserve.gen_server.kv_source import KVSource, UcxKVSource, make_kv_source
from helixserve.gen_server.world import start_gen_world, world_layout
from helixserve.models.dummy import tokenizer_of
from helixserve.parallel import DistEnv
from helixserve.protocol import InvalidRequestError, RequestType
from helixserve.serving.loading import make_worker, wrap_core
from helixserve.serving.openai_serving import PreparedRequest
from helixserve.serving.prefix_metrics import PrefixCacheCollector
from helixserve.serving.warm_up import WarmUp
from helixserve.serving.worker_app import Worker, aggregated_handler, build_worker_app, respond
from helixserve.serving.world_core import WorldCore, serve_world_rank, world_options
from helixserve.serving.world_supervisor import RankCacheCollector, ServedWorld

logger = logging.getLogger(__name__)


class GenerationOnlyHandler:
    """Stages 1-4 for a request whose prefill ran on a ctx worker."""

    def __init__(self, worker: Worker, kv_source: KVSource) -> None:
        self.worker = worker
        self.kv_source = kv_source

    async def __call__(self, http_request: Request, prepared: PreparedRequest) -> Response:
        params = prepared.disaggregated_params
        assert params is not None and params.layout is not None  # validated by the protocol
        mismatches = self.worker.layout.mismatches(params.layout)
        if mismatches:
            raise InvalidRequestError("the ctx worker's KV layout does not match this gen "
                                      f"worker's: {'; '.join(mismatches)}",
                                      param="disaggregated_params.layout", code="layout_mismatch")
        outputs = self.kv_source.generate(self.worker.engine, prepared.request_id, params,
                                          prepared.params)
        if params.cached_tokens is not None:
            outputs = with_cached_tokens(outputs, params.cached_tokens)
        return await respond(self.worker, http_request, prepared, outputs)


async def with_cached_tokens(outputs: AsyncIterator[RequestOutput], cached_tokens: int) -> AsyncIterator[RequestOutput]:
    """``outputs`` answering the ctx's prefix-cache hit as their cached prompt tokens (the gen's
    engine computed none of the prompt)."""
    async for output in outputs:
        output.num_cached_tokens = cached_tokens
        yield output


def build_gen_app(deploy: DeploymentConfig, server: GenServerConfig, env: DistEnv | None = None) -> FastAPI:
    """Load the engine and build the app (the engine thread starts with the app).

    With ``server.runs_world`` this process becomes rank 0 of the SPMD world (see
    :mod:`.world`; ``env``: the srun / torchrun rank, when a launcher started the other ranks),
    and the world is shut down after the engine thread stops.
    """
    if not server.runs_world:
        worker, _ = make_worker("gen", deploy, server.max_queue_len, server.device, server.speculative)
        kv_source = make_kv_source(server.kv_source, worker.layout, deploy.transceiver, server.cp,
                                   deploy.ctx_transceivers)
        return _app(worker, kv_source, deploy, server)
    options, layout, kv_source, factory = _world_parts(deploy, server)
    world = start_gen_world(deploy, server, options, factory, env)
    try:
        driver = world.driver
        tokenizer = tokenizer_of(deploy.model.path, deploy.model.load_format)
        worker = wrap_core("gen", deploy, WorldCore(world), tokenizer, driver.core.model_config, layout,
                           driver.core.scheduler.max_model_len, server.max_queue_len,
                           num_running_slots=server.dp * deploy.cache.max_num_seqs)
    except BaseException:
        world.close()
        raise
    worker.failure = world.failure
    if server.speculative is not None:  # every CP group's counts, through the current world's driver
        worker.export_spec_decode(lambda: world.driver.spec_stats)
    if deploy.cache.prefix_caching:
        worker.registry.register(PrefixCacheCollector(lambda: world.driver.prefix_stats, {"role": worker.role}))
    logger.info("gen worker drives a dp=%d x cp=%d world (kv_source %s)", server.dp, server.cp, server.kv_source)
    return _app(worker, kv_source, deploy, server, world)


def run_gen_rank(deploy: DeploymentConfig, server: GenServerConfig, env: DistEnv) -> int:
    """A task != 0 of an srun / torchrun gen world: serves plans, no HTTP (see :mod:`.world`)."""
    options, _, _, factory = _world_parts(deploy, server)
    return serve_world_rank(deploy, "gen", server.dp, server.cp, options, factory, env)


def _world_parts(deploy: DeploymentConfig, server: GenServerConfig):  # noqa: ANN202
    options = world_options(deploy, server)
    layout = world_layout(deploy, server, options)
    kv_source = make_kv_source(server.kv_source, layout, deploy.transceiver, server.cp, deploy.ctx_transceivers)
    factory = kv_source.receiver_factory() if isinstance(kv_source, UcxKVSource) else None
    return options, layout, kv_source, factory


def _app(worker: Worker, kv_source: KVSource, deploy: DeploymentConfig, server: GenServerConfig,
         world: ServedWorld | None = None) -> FastAPI:
    # through the engine: a world's driver runs it on every rank (prefill, then decode steps)
    worker.warm_up = WarmUp.for_deployment("gen", deploy, server.warm_up, server.warm_up_timeout_s,
                                           num_requests=server.dp if world is not None else 1)
    worker.extra_gauges = kv_source.gauges
    worker.extra_stats = kv_source.stats if world is None else lambda: {**kv_source.stats(),
                                                                         "world": world.describe()}
    handlers = {
        None: aggregated_handler(worker),
        RequestType.GENERATION_ONLY: GenerationOnlyHandler(worker, kv_source),
    }
    if world is not None:
        worker.registry.register(RankCacheCollector(worker.role, world))
    app = build_worker_app(worker, handlers, after_shutdown=(world.close,) if world is not None else ())
    app.state.world = world
    return app
