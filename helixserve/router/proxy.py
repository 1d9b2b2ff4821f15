"""One request through the workers: ctx prefill, then gen decode, streamed back as produced.

Hops (DESIGN.md, "One request, end to end"): the router sends the client's request to a ctx
worker as ``context_only`` (never streamed); if the ctx answer already finished (stop at the first
token, or ``max_tokens == 1``) it is returned as is; otherwise the request goes to a gen worker as
``generation_only`` with the ctx's params, and the gen answer (or SSE stream, relayed event by
event) goes back to the client. The ctx hold is released once the gen worker has answered.

A :class:`Flight` follows the request until its last byte: whatever way it ends (done, worker
failure, client disconnect), :meth:`Flight.close` runs once, cancels what is still running on the
workers (``POST /v1/abort``), frees the inflight slot and records the metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from helixserve.protocol import (SSE_DONE, ChatCompletionRequest, CompletionRequest,
                                 DisaggregatedParams, GatewayTimeoutError, InternalServerError,
                                 OpenAIError, ResponseMeta, ServiceUnavailableError, Usage,
                                 chat_completion_chunk, chat_completion_response,
                                 chat_usage_chunk, completion_chunk, completion_response,
                                 completion_usage_chunk, error_from_body, sse_error, sse_event)
from helixserve.router.metrics import RouterMetrics
from helixserve.router.pool import WorkerPool, WorkerState
from helixserve.router.upstream import Answer, Stream, Upstream, UpstreamError
from helixserve.serving.auth import INVALID_INTERNAL_SECRET
from helixserve.serving.http import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)

GenerationRequest = CompletionRequest | ChatCompletionRequest


class Flight:
    """One request's state in the router, closed exactly once."""

    def __init__(self, orchestrator: Orchestrator, endpoint: str, t_arrival: float,
                 on_close: Callable[[], None], block_keys: Sequence[bytes] = ()) -> None:
        self.o = orchestrator
        self.request_id = f"rt-{uuid.uuid4().hex}"
        self.endpoint = endpoint
        self.t_arrival = t_arrival
        self.on_close = on_close
        self.block_keys = block_keys  # the prompt's block keys (cache_aware routing; else none)
        self.ctx: WorkerState | None = None  # set while ctx may still hold or run the request
        self.ctx_admission: int | None = None  # the ctx's admission of it, named by the release
        self.gen: WorkerState | None = None
        self.gen_response: Stream | None = None
        self.status = "499"  # until something better is known: the client went away
        self.is_complete = False
        self.is_closed = False

    def start(self, worker: WorkerState) -> None:
        worker.num_inflight += 1

    def close(self) -> None:
        """Cancel leftovers on the workers, free the slot, record metrics (sync: safe in a
        cancelled task's ``finally``)."""
        if self.is_closed:
            return
        self.is_closed = True
        for worker in (self.ctx, self.gen):
            if worker is not None:
                worker.num_inflight -= 1
                if not self.is_complete:
                    self.o.fire(self.o.post_quietly(worker, "/v1/abort", self.request_id))
        if self.gen_response is not None:
            self.gen_response.close()
        metrics = self.o.metrics
        metrics.requests.labels(self.endpoint, self.status).inc()
        metrics.e2e.observe(time.monotonic() - self.t_arrival)
        self.on_close()

    def fail(self, err: OpenAIError) -> OpenAIError:
        self.status = str(err.status_code)
        return err


class _RelayResponse(StreamingResponse):
    """A stream whose flight is closed however the response ends (even if never iterated)."""

    def __init__(self, content: AsyncIterator[str], flight: Flight) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={REQUEST_ID_HEADER: flight.request_id})
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.close()


class Orchestrator:
    """ctx -> gen orchestration over two pools and one shared HTTP client."""

    def __init__(self, ctx_pool: WorkerPool, gen_pool: WorkerPool, client: Upstream,
                 metrics: RouterMetrics, control_timeout_s: float) -> None:
        self.ctx_pool, self.gen_pool = ctx_pool, gen_pool
        self.control_timeout_s = control_timeout_s  # RouterConfig.control_timeout_s
        self.client = client
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    def fire(self, work: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def post_quietly(self, worker: WorkerState, path: str, request_id: str, **fields: Any) -> None:
        """POST ``{"request_id": request_id, **fields}`` to a worker's control ``path``; a failure
        is logged, never raised."""
        try:
            await self.client.post(f"{worker.url}{path}", {"request_id": request_id, **fields},
                                   timeout_s=self.control_timeout_s)
        except UpstreamError as exc:
            logger.info("%s %s%s failed: %s", request_id, worker.url, path, exc)

    def transport_error(self, pool: WorkerPool, worker: WorkerState, exc: UpstreamError,
                        during: str) -> OpenAIError:
        """A worker that cannot be reached or broke the connection is marked unhealthy."""
        cause = str(exc)
        if exc.timed_out:
            return GatewayTimeoutError(f"{pool.role} worker {worker.url} did not answer in time "
                                       f"{during} ({cause})")
        pool.mark_failed(worker, cause)
        return ServiceUnavailableError(f"{pool.role} worker {worker.url} failed {during}: {cause}",
                                       code=f"{pool.role}_worker_failed")

    async def run(self, flight: Flight, path: str, body: GenerationRequest, raw: dict) -> Response:
        """Hops 2-7 for one request; raises an ``OpenAIError`` before any byte was answered."""
        ctx_answer = await self._prefill(flight, path, raw)
        choice = (ctx_answer.get("choices") or [{}])[0]
        if choice.get("finish_reason") is not None:
            self.metrics.ttft.observe(time.monotonic() - flight.t_arrival)
            return self._answer_from_ctx(flight, body, ctx_answer)
        try:
            params = DisaggregatedParams.model_validate(ctx_answer.get("disaggregated_params"))
            gen_params = params.for_generation()
            flight.ctx_admission = params.ctx_admission
        except ValidationError as exc:
            raise flight.fail(InternalServerError(
                f"ctx worker {flight.ctx.url} answered without usable disaggregated_params: "
                f"{exc.errors(include_url=False)[0]['msg']}")) from None
        gen_body = {**raw, "disaggregated_params": gen_params.model_dump(mode="json")}
        if body.stream:
            gen_body["stream_options"] = {"include_usage": True}
        return await self._decode(flight, path, body, gen_body)

    async def _prefill(self, flight: Flight, path: str, raw: dict) -> dict:
        ctx = flight.ctx = self.ctx_pool.pick(flight.block_keys)
        flight.start(ctx)
        body = {**raw, "stream": False, "disaggregated_params": {"request_type": "context_only"}}
        body.pop("stream_options", None)
        try:
            answer = await self.client.post(f"{ctx.url}{path}", body,
                                            headers={REQUEST_ID_HEADER: flight.request_id})
        except UpstreamError as exc:
            raise flight.fail(self.transport_error(self.ctx_pool, ctx, exc, "during prefill"))
        payload = answer.json()
        if answer.status != 200:
            ctx.num_inflight -= 1
            flight.ctx = None  # the ctx worker failed it: nothing left there
            raise flight.fail(self.worker_error(self.ctx_pool, ctx, answer.status, payload))
        return payload

    def worker_error(self, pool: WorkerPool, worker: WorkerState, status: int, payload: Any) -> OpenAIError:
        """A worker's error answer for the client. A worker's 401 / 403 on a router hop is this
        deployment's fault, not the client's: 503 naming the cause (a worker refusing this
        router's internal secret is also marked unhealthy)."""
        error = payload.get("error") if isinstance(payload, dict) else None
        if status not in (401, 403) or not isinstance(error, dict):
            return error_from_body(status, payload)
        if error.get("code") == INVALID_INTERNAL_SECRET:
            cause = "it refuses this router's internal secret (HELIXSERVE_INTERNAL_SECRET differs)"
            pool.mark_failed(worker, cause)
        else:  # e.g. a worker without a secret, or gen refusing the ctx endpoint: the deployment's fault
            cause = f"it answered {status}: {error.get('message')}"
        return ServiceUnavailableError(f"{pool.role} worker {worker.url} cannot serve this router: {cause}",
                                       code=f"{pool.role}_worker_failed")

    def _release_ctx(self, flight: Flight) -> None:
        """The gen worker has the request: free the ctx hold."""
        ctx, flight.ctx = flight.ctx, None
        if ctx is not None:
            ctx.num_inflight -= 1
            self.fire(self.post_quietly(ctx, "/v1/release", flight.request_id, admission=flight.ctx_admission))

    async def _decode(self, flight: Flight, path: str, body: GenerationRequest, gen_body: dict
                      ) -> Response:
        gen = flight.gen = self.gen_pool.pick()
        flight.start(gen)
        try:
            response = await self.client.open(f"{gen.url}{path}", gen_body,
                                              headers={REQUEST_ID_HEADER: flight.request_id})
            flight.gen_response = response
            if response.status != 200 or not body.stream:
                answer = Answer(response.status, await response.read())
        except UpstreamError as exc:
            self.metrics.handoff_failures.inc()
            raise flight.fail(self.transport_error(self.gen_pool, gen, exc, "during decode"))
        if response.status != 200:
            self.metrics.handoff_failures.inc()
            raise flight.fail(self.worker_error(self.gen_pool, gen, answer.status, answer.json()))
        self._release_ctx(flight)
        if not body.stream:
            payload = answer.json()
            self.metrics.count_usage(payload.get("usage"))
            flight.status, flight.is_complete = "200", True
            flight.close()
            return Response(answer.body, media_type="application/json",
                            headers={REQUEST_ID_HEADER: flight.request_id})
        return _RelayResponse(self._relay(flight, response, body), flight)

    async def _relay(self, flight: Flight, response: Stream, body: GenerationRequest
                     ) -> AsyncIterator[str]:
        """Gen's SSE events to the client as they come; gen's usage chunk only if asked for."""
        last_token_at: float | None = None
        try:
            async for line in response.lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    flight.status, flight.is_complete = "200", True
                    yield SSE_DONE
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    err = flight.fail(InternalServerError(f"gen worker sent a malformed event: "
                                                          f"{data[:200]!r}"))
                    yield sse_error(err)
                    return
                if "error" in event:
                    flight.status, flight.is_complete = "stream_error", True  # gen ended it
                    yield f"{line}\n\n"
                    return
                if not event.get("choices"):
                    self.metrics.count_usage(event.get("usage"))
                    if body.include_usage:
                        yield f"{line}\n\n"
                    continue
                if _has_content(event):
                    now = time.monotonic()
                    if last_token_at is None:
                        self.metrics.ttft.observe(now - flight.t_arrival)
                    else:
                        self.metrics.itl.observe(now - last_token_at)
                    last_token_at = now
                yield f"{line}\n\n"
            raise UpstreamError(ConnectionResetError("the stream ended without [DONE]"))
        except UpstreamError as exc:
            assert flight.gen is not None
            err = flight.fail(self.transport_error(self.gen_pool, flight.gen, exc, "mid-stream"))
            yield sse_error(err)

    def _answer_from_ctx(self, flight: Flight, body: GenerationRequest, answer: dict) -> Response:
        """The request finished at its first token on ctx: answer in the client's shape."""
        ctx, flight.ctx = flight.ctx, None
        if ctx is not None:
            ctx.num_inflight -= 1  # ctx freed it already
        choice = answer["choices"][0]
        usage = Usage.model_validate(answer["usage"])
        self.metrics.count_usage(answer["usage"])
        text, reason = choice.get("text", ""), choice["finish_reason"]
        is_chat = isinstance(body, ChatCompletionRequest)
        meta = (ResponseMeta.for_chat if is_chat else ResponseMeta.for_completion)(body.model)
        flight.status, flight.is_complete = "200", True
        if not body.stream:
            flight.close()
            build = chat_completion_response if is_chat else completion_response
            return Response(build(meta, text, reason, usage).model_dump_json(),
                            media_type="application/json")
        if is_chat:
            events = [chat_completion_chunk(meta, "", is_first=True),
                      chat_completion_chunk(meta, text or None, reason)]
        else:
            events = [completion_chunk(meta, text, reason)]
        if body.include_usage:
            events.append((chat_usage_chunk if is_chat else completion_usage_chunk)(meta, usage))

        async def replay() -> AsyncIterator[str]:
            for event in events:
                yield sse_event(event)
            yield SSE_DONE

        return _RelayResponse(replay(), flight)


def _has_content(event: dict) -> bool:
    choice = event["choices"][0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))
