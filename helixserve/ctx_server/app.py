"""The ctx worker's app: ``context_only`` requests (stages in the package docstring), plain
requests aggregated, and ``POST /v1/release`` for pickups."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.ctx_server.pickup import PickupRegistry
from helixserve.protocol import DisaggregatedParams, RequestType, TransceiverEndpoint, parse_model
from helixserve.protocol.openai import CompletionChoice, CompletionResponse
from helixserve.serving.http import run_unless_disconnected
from helixserve.serving.loading import make_worker
from helixserve.serving.openai_serving import PreparedRequest, collect_outputs
from helixserve.serving.worker_app import (AbortRequest, Worker, aggregated_handler,
                                           build_worker_app)

logger = logging.getLogger(__name__)


class ContextOnlyHandler:
    """Stages 2-4: prefill and first token with the cache held, then the answer with params.

    The answer is always a ``text_completion`` object (also for chat: it is the router's internal
    hop). ``finish_reason`` null means "continue on a gen worker" and the cache is held; a
    request finished at its first token is answered with its final text and freed at once.
    """

    def __init__(self, worker: Worker, registry: PickupRegistry, endpoint: TransceiverEndpoint
                 ) -> None:
        self.worker = worker
        self.registry = registry
        self.endpoint = endpoint

    async def __call__(self, http_request: Request, prepared: PreparedRequest) -> Response:
        rid, params = prepared.request_id, prepared.params
        engine = self.worker.engine
        outputs = engine.generate(rid, prepared.prompt_token_ids,
                                  params.model_copy(update={"max_tokens": 1}), hold_cache=True)
        self.registry.hold(rid, prepared.prompt_token_ids)
        try:
            done = await run_unless_disconnected(http_request, collect_outputs(outputs))
        except BaseException:
            self.registry.forget(rid)  # failed or cancelled: the engine freed it
            raise
        self.worker.prompt_tokens.labels(self.worker.role).inc(done.num_prompt_tokens)
        self.worker.generation_tokens.labels(self.worker.role).inc(done.num_output_tokens)
        is_finished = done.finish_reason == "stop" or params.max_tokens == 1
        if is_finished:
            self.registry.forget(rid)
            await engine.release(rid)
        else:
            self.registry.mark_ready(rid, done.token_ids)
        disagg = DisaggregatedParams(
            request_type=RequestType.CONTEXT_ONLY, ctx_request_id=rid,
            first_gen_tokens=done.token_ids, prompt_token_ids=prepared.prompt_token_ids,
            ctx_endpoint=self.endpoint, layout=self.worker.layout)
        choice = CompletionChoice(text=done.text if is_finished else "",
                                  finish_reason=done.finish_reason if is_finished else None)
        answer = CompletionResponse(**prepared.meta.header(), choices=[choice], usage=done.usage,
                                    disaggregated_params=disagg)
        return Response(answer.model_dump_json(), media_type="application/json")


def build_ctx_app(deploy: DeploymentConfig, server: CtxServerConfig) -> FastAPI:
    """Load the engine and build the app (the engine thread starts with the app)."""
    registry: PickupRegistry | None = None
    worker = make_worker("ctx", deploy, server.max_queue_len, server.device,
                         extra_gauges=lambda: registry.gauges() if registry else [])
    registry = PickupRegistry(worker.engine, server.pickup_timeout_s)
    worker.on_abort = registry.forget
    endpoint = TransceiverEndpoint(host=server.transceiver_host, port=server.transceiver_port)
    handlers = {
        None: aggregated_handler(worker),
        RequestType.CONTEXT_ONLY: ContextOnlyHandler(worker, registry, endpoint),
    }
    app = build_worker_app(worker, handlers, lifespan_hooks=(registry.running,))

    @app.post("/v1/release")
    async def release(http_request: Request) -> Response:
        body = parse_model(AbortRequest, await http_request.body())
        return JSONResponse({"request_id": body.request_id,
                             "released": await registry.release(body.request_id)})

    app.state.pickups = registry
    return app
