"""The ctx worker's app: ``context_only`` requests (stages in the package docstring), plain
requests aggregated, the KV sender (:mod:`.transfer`) and ``POST /v1/release`` for pickups."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.ctx_server.pickup import HeldPrefill, PickupRegistry
from helixserve.ctx_server.transfer import CtxTransceiver
from helixserve.protocol import (DisaggregatedParams, InternalServerError, InvalidRequestError,
                                 RequestCancelledError, RequestType, parse_model)
from helixserve.protocol.openai import CompletionChoice, CompletionResponse
from helixserve.serving.http import run_unless_disconnected
from helixserve.serving.loading import make_worker
from helixserve.serving.openai_serving import PreparedRequest, collect_outputs
from helixserve.serving.worker_app import (AbortRequest, Worker, aggregated_handler,
                                           build_worker_app)

logger = logging.getLogger(__name__)


class ContextOnlyHandler:
    """Stages 2-4: prefill and first token with the cache held, offered to the KV sender, then the
    answer with params.

    The answer is always a ``text_completion`` object (also for chat: it is the router's internal
    hop). ``finish_reason`` null means "continue on a gen worker" and the cache is held; a
    request finished at its first token is answered with its final text and freed at once.
    """

    def __init__(self, worker: Worker, registry: PickupRegistry, transceiver: CtxTransceiver) -> None:
        self.worker = worker
        self.registry = registry
        self.transceiver = transceiver

    async def __call__(self, http_request: Request, prepared: PreparedRequest) -> Response:
        rid, params = prepared.request_id, prepared.params
        engine = self.worker.engine
        if self.registry.get(rid) is not None:  # refused before it can touch the holder's cache
            raise InvalidRequestError(f"request id {rid!r} is already held here",
                                      code="duplicate_request_id")
        outputs = engine.generate(rid, prepared.prompt_token_ids,
                                  params.model_copy(update={"max_tokens": 1}), hold_cache=True)
        held = self.registry.hold(rid, prepared.prompt_token_ids)
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
            await self._offer(held, len(prepared.prompt_token_ids), done.token_ids)
        disagg = DisaggregatedParams(
            request_type=RequestType.CONTEXT_ONLY, ctx_request_id=rid,
            first_gen_tokens=done.token_ids, prompt_token_ids=prepared.prompt_token_ids,
            ctx_endpoint=self.transceiver.endpoint, layout=self.worker.layout)
        choice = CompletionChoice(text=done.text if is_finished else "",
                                  finish_reason=done.finish_reason if is_finished else None)
        answer = CompletionResponse(**prepared.meta.header(), choices=[choice], usage=done.usage,
                                    disaggregated_params=disagg)
        return Response(answer.model_dump_json(), media_type="application/json")

    async def _offer(self, held: HeldPrefill, num_prompt_tokens: int, first_gen_tokens: list[int]) -> None:
        """Stage 3 -> the KV sender; from then on it frees the cache (see ``transfer``)."""
        rid = held.request_id
        try:
            await self.transceiver.offer(rid, num_prompt_tokens, first_gen_tokens)
        except Exception as exc:
            self.registry.forget(rid)
            await self.worker.engine.release(rid)
            if held.is_cancelled:
                raise RequestCancelledError(f"request {rid} was cancelled") from None
            logger.exception("offering ctx request %s to the KV sender failed", rid)
            raise InternalServerError(f"the ctx worker's KV sender did not take request {rid}: "
                                      f"{type(exc).__name__}: {exc}", code="kv_sender_failed") from None
        held.is_offered = True
        if held.is_cancelled:  # the client left while it was offered
            await self.transceiver.cancel(rid, "the client went away")
            raise RequestCancelledError(f"request {rid} was cancelled")


def build_ctx_app(deploy: DeploymentConfig, server: CtxServerConfig) -> FastAPI:
    """Load the engine and build the app (the engine thread, then the KV sender, start with it)."""
    worker, core = make_worker("ctx", deploy, server.max_queue_len, server.device)
    registry = PickupRegistry(worker.engine, server.pickup_timeout_s)
    transceiver = CtxTransceiver(registry, core, worker.layout, deploy.transceiver, server)
    worker.extra_gauges = lambda: [
        *registry.gauges(num_expired_by_sender=int(transceiver.stats()["kv_pickups_expired"])),
        *transceiver.gauges()]
    worker.extra_stats = transceiver.stats
    worker.on_abort = registry.forget

    async def abort_offered(request_id: str) -> bool:
        held = registry.get(request_id)
        if held is None or not held.is_ready:
            return False  # prefilling (or gone): the engine's abort frees it
        held.is_cancelled = True
        if held.is_offered:
            await transceiver.cancel(request_id, "the client went away")
        return True  # the sender frees it once no send can read it (or _offer does)

    worker.abort_override = abort_offered
    handlers = {
        None: aggregated_handler(worker),
        RequestType.CONTEXT_ONLY: ContextOnlyHandler(worker, registry, transceiver),
    }
    app = build_worker_app(worker, handlers, lifespan_hooks=(registry.running, transceiver.running))

    @app.post("/v1/release")
    async def release(http_request: Request) -> Response:
        body = parse_model(AbortRequest, await http_request.body())
        held = registry.get(body.request_id)
        if held is not None and held.is_offered:
            transceiver.cancel_later(body.request_id, "released by the router")
            return JSONResponse({"request_id": body.request_id, "released": True})
        return JSONResponse({"request_id": body.request_id,
                             "released": await registry.release(body.request_id)})

    app.state.pickups = registry
    app.state.transceiver = transceiver
    return app
