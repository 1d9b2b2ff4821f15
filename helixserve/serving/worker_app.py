"""The HTTP app both workers share; each role plugs in its request handlers.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream or not), ``GET /v1/models``,
``GET /health`` (liveness: 503 naming the cause once the engine stopped, its warm-up failed or
the role reports a failure, e.g. a dead gen world rank), ``GET /ready`` (200 once the warm-up of
:mod:`helixserve.serving.warm_up` finished and the worker is healthy; 503 ``warming up`` before:
the router routes to ready workers only, and completions are refused meanwhile), ``GET /stats`` (engine counters as JSON), ``GET /metrics`` (Prometheus),
``POST /v1/abort`` (``{"request_id"}``: the router cancels).

A completion request is parsed (400s), checked against the served model (404), routed by its
``disaggregated_params.request_type`` (``None`` = aggregated) to the role's handler, which turns it
into engine outputs; :func:`respond` sends them as one JSON answer or as SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from helixserve.engine.async_engine import AsyncEngine, RequestOutput
from helixserve.engine.errors import EngineError
from helixserve.engine.spec.stats import SpecDecodeStats
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                 CompletionResponse, InvalidRequestError, KVLayout, ModelCard,
                                 ModelList, ModelNotFoundError, RequestType,
                                 ServiceUnavailableError, parse_json, parse_model,
                                 prompt_too_long, raw_prompt_length)
from helixserve.config import SecurityConfig, ShutdownConfig
from helixserve.serving.auth import install_internal_auth
from helixserve.serving.connection_metrics import ConnectionCollector, guard_counts
from helixserve.serving.engine_errors import install_engine_error_handler, openai_outputs, to_openai_error
from helixserve.serving.http import (OFF_LOOP_BYTES, BodyLimit, InternalErrors, OffLoop,
                                    install_error_handlers, request_id_from,
                                    run_unless_disconnected)
from helixserve.serving.openapi import GENERATION_ERRORS, Operation, install_openapi
from helixserve.serving.spec_metrics import SpecDecodeCollector
from helixserve.serving.openai_serving import (PreparedRequest, ServingLimits, answer_json,
                                               collect_outputs, prepare, sse_stream)
from helixserve.serving.warm_up import WarmUp

RequestHandler = Callable[[Request, PreparedRequest], Awaitable[Response]]


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128)


class AbortResponse(BaseModel):
    """``aborted``: whether the request was live here (and is now cancelled)."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    aborted: bool


# a ctx worker answers a context_only chat request with a text_completion object (its hop)
_ANSWERS = (CompletionResponse, ChatCompletionResponse)
_INTERNAL = (401, 403)  # no or a wrong internal secret; 403: this worker has none (serving/auth.py)
WORKER_OPERATIONS = {
    ("POST", "/v1/completions"): Operation(CompletionRequest, (CompletionResponse,), streams=True,
                                           errors=(*_INTERNAL, *GENERATION_ERRORS)),
    ("POST", "/v1/chat/completions"): Operation(ChatCompletionRequest, _ANSWERS, streams=True,
                                                errors=(*_INTERNAL, *GENERATION_ERRORS)),
    ("GET", "/v1/models"): Operation(response=(ModelList,), errors=_INTERNAL),
    ("GET", "/health"): Operation(errors=(401, 503), error_is_object=(503,)),
    ("GET", "/ready"): Operation(errors=(401, 503), error_is_object=(503,)),
    ("GET", "/stats"): Operation(errors=_INTERNAL),
    ("GET", "/metrics"): Operation(text=True, errors=(401,)),
    ("POST", "/v1/abort"): Operation(AbortRequest, (AbortResponse,), errors=(*_INTERNAL, 400, 413)),
}


class _EngineCollector:
    """Engine gauges read at scrape time."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        role = self._worker.role
        for name, help_text, value in self._worker.gauges():
            gauge = GaugeMetricFamily(f"helixserve_worker_{name}", help_text, labels=["role"])
            gauge.add_metric([role], float(value))
            yield gauge


@dataclass
class Worker:
    """One worker process: its engine, tokenizer, limits, cache layout and metrics."""

    role: str  # "ctx" or "gen"
    engine: AsyncEngine
    tokenizer: HelixTokenizer | None
    limits: ServingLimits
    layout: KVLayout
    extra_gauges: Callable[[], list[tuple[str, str, float]]] = lambda: []
    on_abort: Callable[[str], None] = lambda request_id: None  # after /v1/abort (ctx: holds)
    # asked first on /v1/abort: True when the role frees the request its own way (ctx: a hold
    # the KV sender holds is freed once no send can read it), so the engine abort is skipped
    abort_override: Callable[[str], Awaitable[bool]] | None = None
    failure: Callable[[], str | None] = lambda: None  # why the worker cannot serve (None: it can)
    extra_stats: Callable[[], dict[str, Any]] = lambda: {}  # in /health and /stats (router reads)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    security: SecurityConfig = field(default_factory=SecurityConfig)  # who may call (serving/auth.py)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)  # how long live requests get
    warm_up: WarmUp | None = None  # run by the lifespan before /ready (None: ready at once)
    spec_stats: Callable[[], SpecDecodeStats] | None = None  # speculative decoding's counts (None: off)

    def __post_init__(self) -> None:
        self.requests = Counter("helixserve_worker_requests", "finished HTTP completion requests",
                                ["role", "status"], registry=self.registry)
        self.prompt_tokens = Counter("helixserve_worker_prompt_tokens", "prompt tokens served",
                                     ["role"], registry=self.registry)
        self.generation_tokens = Counter("helixserve_worker_generation_tokens",
                                         "tokens generated", ["role"], registry=self.registry)
        self.registry.register(_EngineCollector(self))
        self.off_loop = OffLoop(self.role)

    def export_spec_decode(self, stats: Callable[[], SpecDecodeStats]) -> None:
        """Publish the engine's speculative decoding counts: on ``/metrics``, and in ``/stats``
        and ``/ready`` as ``spec_decode`` (the router's health checks read them)."""
        self.spec_stats = stats
        self.registry.register(SpecDecodeCollector(stats, {"role": self.role}))

    def failure_cause(self) -> str | None:
        """Why this worker cannot serve now, or None."""
        if not self.engine.is_alive:
            return f"the {self.role} engine is not running"
        warm_up_failure = self.warm_up.failure() if self.warm_up is not None else None
        return warm_up_failure or self.failure()

    def not_ready_cause(self) -> str | None:
        """Why ``/ready`` answers 503 (not healthy, or still warming up), or None."""
        cause = self.failure_cause()
        if cause is None and self.warm_up is not None:
            cause = self.warm_up.not_ready_cause()
        return cause

    @property
    def exit_code(self) -> int | None:
        """1 once the warm-up failed (the worker's command exits with it), else None."""
        return self.warm_up.exit_code if self.warm_up is not None else None

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "role": self.role, "model": self.limits.served_model,
            "is_alive": self.failure_cause() is None,
            "num_live_requests": self.engine.num_live_requests, "num_running": s.num_running,
            "num_waiting": s.num_waiting, "num_held": s.num_held, "num_blocks": s.num_blocks,
            "num_used_blocks": s.num_used_blocks, "num_slots": s.num_slots,
            "num_used_slots": s.num_used_slots, "capacity": self.engine.capacity,
            "warm_up": self.warm_up.describe() if self.warm_up is not None else None,
            **({"spec_decode": asdict(self.spec_stats())} if self.spec_stats is not None else {}),
            **self.extra_stats(),
        }

    def gauges(self) -> list[tuple[str, str, float]]:
        s = self.engine.stats()
        return [
            ("requests_running", "requests in the running batch", s.num_running),
            ("requests_waiting", "requests queued in the engine", s.num_waiting),
            ("requests_live", "requests admitted and not finished", self.engine.num_live_requests),
            ("requests_held", "finished prefills holding their cache for its gen worker", s.num_held),
            ("cache_blocks_total", "MLA cache blocks", s.num_blocks),
            ("cache_blocks_used", "MLA cache blocks in use", s.num_used_blocks),
            ("state_slots_total", "KDA state slots", s.num_slots),
            ("state_slots_used", "KDA state slots in use", s.num_used_slots),
            *self.extra_gauges(),
        ]

    def count_tokens(self, out: RequestOutput) -> None:
        self.prompt_tokens.labels(self.role).inc(out.num_prompt_tokens)
        self.generation_tokens.labels(self.role).inc(out.num_output_tokens)


async def _counted(worker: Worker, outputs: AsyncIterator[RequestOutput]
                   ) -> AsyncIterator[RequestOutput]:
    async for out in outputs:
        if out.is_finished:
            worker.count_tokens(out)
        yield out


async def respond(worker: Worker, http_request: Request, prepared: PreparedRequest,
                  outputs: AsyncIterator[RequestOutput]) -> Response:
    """Send a request's outputs as one JSON answer, or as SSE when it asked to stream. A client
    that leaves aborts the request (the engine frees its cache)."""
    outputs = _counted(worker, openai_outputs(outputs))
    if not prepared.is_stream:
        done = await run_unless_disconnected(http_request, collect_outputs(outputs))
        return Response(answer_json(prepared, done), media_type="application/json")
    first = await run_unless_disconnected(http_request, anext(outputs))

    async def events() -> AsyncIterator[str]:
        is_complete = False
        try:
            async for event in sse_stream(prepared, first, outputs):
                yield event
            is_complete = True
        finally:
            if not is_complete:  # cancelled by a disconnect: no await allowed here
                worker.engine.abort(prepared.request_id)

    return StreamingResponse(events(), media_type="text/event-stream")


def aggregated_handler(worker: Worker) -> RequestHandler:
    """Prefill and decode here: a gen worker's baseline, and a ctx worker's plain requests."""

    async def handle(http_request: Request, prepared: PreparedRequest) -> Response:
        outputs = worker.engine.generate(prepared.request_id, prepared.prompt_token_ids,
                                         prepared.params)
        return await respond(worker, http_request, prepared, outputs)

    return handle


async def handle_completion(worker: Worker, handlers: Mapping[RequestType | None, RequestHandler],
                            http_request: Request, cls: type) -> Response:
    """:func:`_complete`, counted in ``helixserve_worker_requests`` by status whatever the
    outcome (a refused body too)."""
    status = "500"
    try:
        response = await _complete(worker, handlers, http_request, cls)
        status = str(response.status_code)
        return response
    except EngineError as err:  # e.g. from AsyncEngine.call: the client gets its OpenAI error
        openai_err = to_openai_error(err)
        status = str(openai_err.status_code)
        raise openai_err from err
    except Exception as err:
        status = str(getattr(err, "status_code", 500))
        raise
    finally:
        worker.requests.labels(worker.role, status).inc()


async def _complete(worker: Worker, handlers: Mapping[RequestType | None, RequestHandler],
                    http_request: Request, cls: type) -> Response:
    """Parse (400/413), check the model (404), pick the role's handler by request type, tokenize
    (a large body's parsing and tokenizing off the event loop), run it."""
    raw_bytes = await http_request.body()
    is_large = len(raw_bytes) > OFF_LOOP_BYTES
    raw = await worker.off_loop.run_if(is_large, parse_json, raw_bytes)
    del raw_bytes
    limits = worker.limits
    num_ids = raw_prompt_length(raw)
    if num_ids is not None and num_ids > limits.max_prompt_tokens:
        raise prompt_too_long(num_ids, limits.max_prompt_tokens, limits.max_model_len)
    body = await worker.off_loop.run_if(is_large, parse_model, cls, raw)
    if body.model != worker.limits.served_model:
        raise ModelNotFoundError(body.model)
    params = body.disaggregated_params
    request_type = params.request_type if params is not None else None
    handler = handlers.get(request_type)
    if handler is None:
        raise InvalidRequestError(f"this {worker.role} worker does not serve "
                                  f"{request_type or 'aggregated'} requests",
                                  param="disaggregated_params.request_type")
    cause = worker.failure_cause()
    if cause is not None:
        raise ServiceUnavailableError(f"{worker.role} worker cannot serve: {cause}",
                                      code=f"{worker.role}_worker_failed")
    if worker.not_ready_cause() is not None:  # its warm-up runs: it owns the engine until done
        raise ServiceUnavailableError(f"{worker.role} worker is not ready: warming up",
                                      code=f"{worker.role}_worker_warming_up")
    request_id = request_id_from(http_request, worker.engine.new_request_id(worker.role))
    prepared = await worker.off_loop.run_if(is_large or cls is ChatCompletionRequest, prepare,
                                            request_id, body, worker.tokenizer, worker.limits)
    return await handler(http_request, prepared)


def build_worker_app(worker: Worker, handlers: Mapping[RequestType | None, RequestHandler],
                     lifespan_hooks: tuple[Callable[[], Any], ...] = (),
                     after_shutdown: tuple[Callable[[], None], ...] = ()) -> FastAPI:
    """The app; ``handlers`` maps a request type (``None``: no disaggregated_params) to the
    role's handler; ``lifespan_hooks`` are async context managers entered after the engine starts;
    ``after_shutdown`` run (in order, in a thread) once the engine thread stopped (e.g. closing
    the gen world the engine drove). The worker's warm-up starts once the hooks are in and runs
    while the server answers (``/ready`` 503 until it is done)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.engine.start()
        try:
            async with contextlib.AsyncExitStack() as stack:
                for hook in lifespan_hooks:
                    await stack.enter_async_context(hook())
                if worker.warm_up is not None:
                    worker.warm_up.start(worker.engine, worker.limits)
                    stack.push_async_callback(worker.warm_up.stop)
                yield
        finally:
            worker.off_loop.shutdown()
            try:
                await worker.engine.shutdown(worker.shutdown.requests_grace_s)
            finally:
                for fn in after_shutdown:
                    await asyncio.to_thread(fn)

    app = FastAPI(title=f"helixserve {worker.role} worker", lifespan=lifespan)
    worker.registry.register(ConnectionCollector("helixserve_worker", lambda: guard_counts(getattr(app.state, "connection_guard", None)),
                                                 {"role": worker.role}))
    install_internal_auth(app, worker.security)  # innermost: the body limit applies first
    app.add_middleware(BodyLimit, max_body_bytes=worker.limits.max_body_bytes)
    app.add_middleware(InternalErrors)
    install_error_handlers(app)
    install_engine_error_handler(app)
    install_openapi(app, WORKER_OPERATIONS)
    started_at = int(time.time())  # /v1/models "created": when this worker started

    @app.post("/v1/completions")
    async def completions(http_request: Request) -> Response:
        return await handle_completion(worker, handlers, http_request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request) -> Response:
        return await handle_completion(worker, handlers, http_request, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=worker.limits.served_model, created=started_at)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        stats = worker.stats()
        cause = worker.failure_cause()
        return JSONResponse({**stats, "status": "ok" if cause is None else cause},
                            status_code=200 if cause is None else 503)

    @app.get("/ready")
    async def ready() -> Response:
        stats = worker.stats()
        cause = worker.not_ready_cause()
        return JSONResponse({**stats, "status": "ok" if cause is None else cause},
                            status_code=200 if cause is None else 503)

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse({**worker.stats(), **{n: v for n, _, v in worker.extra_gauges()}})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(worker.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/abort")
    async def abort(http_request: Request) -> Response:
        body = parse_model(AbortRequest, await http_request.body())
        rid = body.request_id
        is_aborted = worker.abort_override is not None and await worker.abort_override(rid)
        if not is_aborted:
            is_aborted = worker.engine.is_live(rid)
            worker.engine.abort(rid, f"request {rid} was cancelled")
        worker.on_abort(rid)
        return Response(AbortResponse(request_id=rid, aborted=is_aborted).model_dump_json(),
                        media_type="application/json")

    app.state.worker = worker
    return app
