"""The gen worker's app: ``generation_only`` requests through a :class:`KVSource` (stages in the
package docstring) and plain requests aggregated."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from helixserve.config import DeploymentConfig, GenServerConfig
from helixserve.gen_server.kv_source import KVSource, make_kv_source
from helixserve.protocol import InvalidRequestError, RequestType
from helixserve.serving.loading import make_worker
from helixserve.serving.openai_serving import PreparedRequest
from helixserve.serving.worker_app import Worker, aggregated_handler, build_worker_app, respond


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
        return await respond(self.worker, http_request, prepared, outputs)


def build_gen_app(deploy: DeploymentConfig, server: GenServerConfig) -> FastAPI:
    """Load the engine and build the app (the engine thread starts with the app).

    A dp x cp > 1 world is the generation-world engine's to drive: it must give an
    :class:`~helixserve.engine.async_engine.EngineCoreLike` on rank 0, passed to ``AsyncEngine``
    in place of the single-process ``EngineCore``.
    """
    if server.dp * server.cp > 1:
        raise ValueError(f"gen worker {server.url}: dp={server.dp} x cp={server.cp} needs the "
                         "SPMD generation world, which gen_server does not drive yet; use dp=1, cp=1")
    kv_source = make_kv_source(server.kv_source)
    worker = make_worker("gen", deploy, server.max_queue_len, server.device)
    handlers = {
        None: aggregated_handler(worker),
        RequestType.GENERATION_ONLY: GenerationOnlyHandler(worker, kv_source),
    }
    return build_worker_app(worker, handlers)
