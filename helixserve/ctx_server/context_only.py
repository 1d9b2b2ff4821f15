"""A ctx worker's ``context_only`` path, the same for one rank and for a ctx world: the handler
(states PREFILLING -> HELD -> SENDING of :mod:`.lifecycle`, then the answer with params), the
client's abort of an offered request and ``POST /v1/release`` for holds. The KV sender behind it
is a :class:`CtxSender`: one rank's (:mod:`.transfer`) or every rank's of a ctx world
(:mod:`.world_transfer`)."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from helixserve.ctx_server.ctx_requests import CtxRequests, OfferFn
from helixserve.ctx_server.lifecycle import CancelRequested, CtxState, Finished, ReleaseCause, ReleaseRequested
from helixserve.protocol import (DisaggregatedParams, InternalServerError, RequestCancelledError,
                                 RequestType, parse_model)
from helixserve.protocol.disagg import PullGrant, TransceiverEndpoint
from helixserve.protocol.openai import CompletionChoice, CompletionResponse
from helixserve.serving.engine_errors import openai_outputs
from helixserve.serving.http import run_unless_disconnected
from helixserve.serving.openai_serving import PreparedRequest, collect_outputs
from helixserve.serving.worker_app import Worker

logger = logging.getLogger(__name__)


class DeferredCancels(ABC):
    """A KV sender front's background work on the event loop: a router release's cancel after
    ``ctx[].release_grace_s`` (the gen ranks may still acknowledge), cancelled when it stops."""

    release_grace_s: float

    def __init__(self, release_grace_s: float) -> None:
        self.release_grace_s = release_grace_s
        self._tasks: set[asyncio.Task] = set()

    @abstractmethod
    async def cancel(self, request_id: str, reason: str) -> bool:
        """Cancel ``request_id``'s hold for ``reason``; whether one was held."""

    def cancel_later(self, request_id: str, reason: str) -> None:
        async def later() -> None:
            await asyncio.sleep(self.release_grace_s)
            await self.cancel(request_id, reason)
        self._spawn(later())

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class CtxSender(Protocol):
    """The ctx worker's KV sender as the ``context_only`` path uses it."""

    @property
    def endpoint(self) -> TransceiverEndpoint: ...
    @property
    def endpoints(self) -> list[TransceiverEndpoint]:
        """A ctx world's every rank's sender, in rank order (one rank: none)."""
    def offer(self, request_id: str, num_prompt_tokens: int, first_gen_tokens: list[int]) -> OfferFn: ...
    def take_grant(self, request_id: str) -> PullGrant | None: ...
    async def cancel(self, request_id: str, reason: str) -> bool: ...
    def cancel_later(self, request_id: str, reason: str) -> None: ...


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

    def __init__(self, worker: Worker, requests: CtxRequests, transceiver: CtxSender) -> None:
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
            ctx_admission=token, ctx_endpoints=self.transceiver.endpoints,
            cached_tokens=done.usage.prompt_tokens_details.cached_tokens if done.usage.prompt_tokens_details else None)
        choice = CompletionChoice(text=done.text if is_finished else "",
                                  finish_reason=done.finish_reason if is_finished else None)
        answer = CompletionResponse(**prepared.meta.header(), choices=[choice], usage=done.usage,
                                    disaggregated_params=disagg)
        return Response(answer.model_dump_json(), media_type="application/json")


def abort_offered(requests: CtxRequests, transceiver: CtxSender) -> Callable[[str], Awaitable[bool]]:
    """The worker's ``POST /v1/abort`` of a ctx request (its ``abort_override``)."""

    async def abort(request_id: str) -> bool:
        moved = await requests.request(CancelRequested(request_id))
        if moved.before in (None, CtxState.PREFILLING):
            return False  # prefilling (or not a ctx request): the engine's abort frees it
        if moved.before is CtxState.SENDING:
            await transceiver.cancel(request_id, "the client went away")
        return True  # freed now (HELD), or by the sender once no send can read it

    return abort


def install_release(app: FastAPI, requests: CtxRequests, transceiver: CtxSender) -> None:
    """``POST /v1/release``: the router is done with a held prefill."""

    @app.post("/v1/release")
    async def release(http_request: Request) -> Response:
        body = parse_model(ReleaseRequest, await http_request.body())
        moved = await requests.request(ReleaseRequested(body.request_id, body.admission))
        if moved.before is CtxState.SENDING:
            transceiver.cancel_later(body.request_id, "released by the router")
        is_released = moved.before in (CtxState.HELD, CtxState.SENDING)
        return JSONResponse({"request_id": body.request_id, "released": is_released})
