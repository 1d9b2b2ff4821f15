"""The ctx worker's app: ``context_only`` requests (stages in the package docstring), plain
requests aggregated, the KV sender (:mod:`.transfer`) and ``POST /v1/release`` for holds."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from helixserve.config import CtxServerConfig, DeploymentConfig
from helixserve.ctx_server.lifecycle import (CancelRequested, CtxState, Finished, ReleaseCause,
                                             ReleaseRequested)
from helixserve.ctx_server.ctx_requests import CtxRequests
from helixserve.ctx_server.transfer import CtxTransceiver
from helixserve.ctx_server.world import build_ctx_world_app
from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager
from helixserve.parallel import DistEnv
from helixserve.protocol import (DisaggregatedParams, InternalServerError, RequestCancelledError,
                                 RequestType, parse_model)
from helixserve.protocol.openai import CompletionChoice, CompletionResponse
from helixserve.serving.engine_errors import openai_outputs
from helixserve.serving.http import run_unless_disconnected
from helixserve.serving.loading import make_worker
from helixserve.serving.openai_serving import PreparedRequest, collect_outputs
from helixserve.serving.prefix_events import install_prefix_events
from helixserve.serving.warm_up import WarmUp
from helixserve.serving.worker_app import Worker, aggregated_handler, build_worker_app

logger = logging.getLogger(__name__)


class ReleaseRequest(BaseModel):
    """``POST /v1/release``: the router is done with ``request_id``'s admission ``admission`` (the
    ``ctx_admission`` of the ctx's answer); a release naming another admission frees nothing."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128)
    admission: int = Field(ge=1, lt=1 << 63)


class ContextOnlyHandler:
    """States PREFILLING -> HELD -> SENDING (or RELEASED) of :mod:`.lifecycle`, then the answer
    with params.

    The answer is always a ``text_completion`` object (also for chat: it is the router's internal
    hop). ``finish_reason`` null means "continue on a gen worker" and the cache is held; a
    request finished at its first token is answered with its final text and freed at once.
    """

    def __init__(self, worker: Worker, requests: CtxRequests, transceiver: CtxTransceiver) -> None:
        self.worker = worker
        self.requests = requests
        self.transceiver = transceiver

    async def __call__(self, http_request: Request, prepared: PreparedRequest) -> Response:
        rid, params = prepared.request_id, prepared.params
        token, outputs = self.requests.generate(rid, prepared.prompt_token_ids,
                                                params.model_copy(update={"max_tokens": 1}))
        try:
            done = await run_unless_disconnected(http_request, collect_outputs(openai_outputs(outputs)))
        except BaseException:  # refused, failed or cancelled: the engine freed it (or never had it)
            self.requests.post(Finished(rid, token, ReleaseCause.FAILED))
            raise
        self.worker.prompt_tokens.labels(self.worker.role).inc(done.num_prompt_tokens)
        self.worker.generation_tokens.labels(self.worker.role).inc(done.num_output_tokens)
        is_finished = done.finish_reason == "stop" or params.max_tokens == 1
        offer = None if is_finished else self.transceiver.offer(
            rid, len(prepared.prompt_token_ids), done.token_ids)
        try:
            state = await self.requests.prefilled(rid, token, done.token_ids, offer)
        except Exception as exc:
            logger.exception("offering ctx request %s to the KV sender failed", rid)
            raise InternalServerError(f"the ctx worker's KV sender did not take request {rid}: "
                                      f"{type(exc).__name__}: {exc}", code="kv_sender_failed") from None
        finally:
            grant = self.transceiver.take_grant(rid)
        if not is_finished and state is not CtxState.SENDING:  # the client left while prefilling
            raise RequestCancelledError(f"request {rid} was cancelled")
        disagg = DisaggregatedParams(
            request_type=RequestType.CONTEXT_ONLY, ctx_request_id=rid,
            first_gen_tokens=done.token_ids, prompt_token_ids=prepared.prompt_token_ids,
            ctx_endpoint=self.transceiver.endpoint, layout=self.worker.layout, pull_grant=grant,
            ctx_admission=token)
        choice = CompletionChoice(text=done.text if is_finished else "",
                                  finish_reason=done.finish_reason if is_finished else None)
        answer = CompletionResponse(**prepared.meta.header(), choices=[choice], usage=done.usage,
                                    disaggregated_params=disagg)
        return Response(answer.model_dump_json(), media_type="application/json")


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

    async def abort_offered(request_id: str) -> bool:
        moved = await requests.request(CancelRequested(request_id))
        if moved.before in (None, CtxState.PREFILLING):
            return False  # prefilling (or not a ctx request): the engine's abort frees it
        if moved.before is CtxState.SENDING:
            await transceiver.cancel(request_id, "the client went away")
        return True  # freed now (HELD), or by the sender once no send can read it

    worker.abort_override = abort_offered
    # a context_only prefill's way: held at its finish, then released (as a gen worker's fetch would)
    worker.warm_up = WarmUp.for_deployment("ctx", deploy, server.warm_up, server.warm_up_timeout_s,
                                           hold_cache=True)
    handlers = {
        None: aggregated_handler(worker),
        RequestType.CONTEXT_ONLY: ContextOnlyHandler(worker, requests, transceiver),
    }
    app = build_worker_app(worker, handlers, lifespan_hooks=(requests.running, transceiver.running))
    cache = core.cache_manager
    if isinstance(cache, PrefixCachingCacheManager) and cache.blocks.events is not None:
        install_prefix_events(app, cache.blocks.events, cache.tokens_per_block)  # the router's index

    @app.post("/v1/release")
    async def release(http_request: Request) -> Response:
        body = parse_model(ReleaseRequest, await http_request.body())
        moved = await requests.request(ReleaseRequested(body.request_id, body.admission))
        if moved.before is CtxState.SENDING:
            transceiver.cancel_later(body.request_id, "released by the router")
        is_released = moved.before in (CtxState.HELD, CtxState.SENDING)
        return JSONResponse({"request_id": body.request_id, "released": is_released})

    app.state.requests = requests
    app.state.transceiver = transceiver
    return app
