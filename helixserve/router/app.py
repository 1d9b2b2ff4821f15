"""The router's app: the public OpenAI endpoints, auth, admission, health and readiness."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from helixserve.config import DeploymentConfig, LimitsConfig, RouterConfig, router_api_keys
from helixserve.models.tokenizer_loader import tokenizer_of
from helixserve.protocol import (AuthenticationError, ChatCompletionRequest,
                                 ChatCompletionResponse, CompletionRequest, CompletionResponse,
                                 InvalidRequestError, ModelCard, ModelList, ModelNotFoundError,
                                 QueueFullError, parse_json, parse_model, prompt_too_long,
                                 raw_prompt_length)
from helixserve.router.metrics import RouterMetrics
from helixserve.router.pool import WorkerPool
from helixserve.router.prefix_index import PrefixIndex
from helixserve.router.prompt_keys import PromptKeys
from helixserve.router.proxy import Flight, Orchestrator
from helixserve.router.upstream import Upstream
from helixserve.serving.auth import internal_headers
from helixserve.serving.connection_metrics import guard_counts
from helixserve.serving.connections import ConnectionGuard
from helixserve.serving.http import (OFF_LOOP_BYTES, BodyLimit, InternalErrors, OffLoop,
                                    install_error_handlers, run_unless_disconnected)
from helixserve.serving.openapi import GENERATION_ERRORS, Operation, install_openapi

logger = logging.getLogger(__name__)

ROUTER_OPERATIONS = {
    ("POST", "/v1/completions"): Operation(CompletionRequest, (CompletionResponse,), streams=True,
                                           errors=(401, *GENERATION_ERRORS)),
    ("POST", "/v1/chat/completions"): Operation(ChatCompletionRequest, (ChatCompletionResponse,),
                                                streams=True, errors=(401, *GENERATION_ERRORS)),
    ("GET", "/v1/models"): Operation(response=(ModelList,), errors=(401,)),
    ("GET", "/health"): Operation(),
    ("GET", "/ready"): Operation(errors=(503,), error_is_object=(503,)),
    ("GET", "/metrics"): Operation(text=True),
}


class Admission:
    """At most :attr:`limit` requests on the workers: ``max_inflight``, lowered to what the
    workers admit (``capacity()``: the smallest pool's, see ``router.pool``); up to
    ``max_queue_len`` more wait for a slot, first come first served; beyond that, 429 at once."""

    def __init__(self, max_inflight: int, max_queue_len: int,
                 capacity: Callable[[], int | None] = lambda: None) -> None:
        self.max_inflight = max_inflight
        self.max_queue_len = max_queue_len
        self._capacity = capacity
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.num_inflight = 0

    @property
    def limit(self) -> int:
        capacity = self._capacity()
        return self.max_inflight if capacity is None else min(self.max_inflight, capacity)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if not self._waiters and self.num_inflight < self.limit:
            self.num_inflight += 1
            return
        if len(self._waiters) >= self.max_queue_len:
            raise QueueFullError(f"the router is at capacity ({self.num_inflight} requests in "
                                 f"flight, the workers admit {self.limit}; {len(self._waiters)} "
                                 f"waiting); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:  # cancelled (client gone) while waiting, or just as it got a slot
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.num_inflight -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the waiters in order (after a release, or the workers' capacity
        grew)."""
        while self._waiters and self.num_inflight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.num_inflight += 1
                waiter.set_result(None)


def _check_api_key(request: Request, api_keys: tuple[str, ...]) -> None:
    if not api_keys:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'.")
    if not any(hmac.compare_digest(key.strip(), k) for k in api_keys):
        raise AuthenticationError("Incorrect API key provided.")


class RouterService:
    """The router's state: pools, admission, metrics and (while running) the orchestrator."""

    def __init__(self, config: RouterConfig, ctx_urls: tuple[str, ...], gen_urls: tuple[str, ...],
                 served_model: str, limits: LimitsConfig = LimitsConfig(),
                 max_model_len: int | None = None, internal_secret: str | None = None,
                 prompt_keys: PromptKeys | None = None) -> None:
        self.config = config
        self.internal_secret = internal_secret  # sent on every hop to a worker
        self.served_model = served_model
        self.limits = limits
        # what the router can check of a token-id prompt without the model (None: the workers)
        known = [n for n in (limits.max_prompt_tokens, max_model_len) if n is not None]
        self.max_prompt_tokens = min(known) if known else None
        self.max_model_len = max_model_len
        self.off_loop = OffLoop("router")
        self.started_at = int(time.time())  # /v1/models "created": when the router started
        # cache_aware: the ctx workers' cached blocks, and the prompts' keys to match them
        self.prompt_keys = prompt_keys if config.policy == "cache_aware" else None
        self.prefix_index = None if self.prompt_keys is None else PrefixIndex(
            ctx_urls, config.prefix_index_max_blocks, self.prompt_keys.tokens_per_block,
            config.cache_aware_load_weight, config.cache_threshold)
        self.ctx_pool = WorkerPool("ctx", ctx_urls, config.policy, self.prefix_index)
        self.gen_pool = WorkerPool("gen", gen_urls, config.policy)
        self.connections: ConnectionGuard | None = None  # the server's, once serving/http.py set it up
        self.metrics = RouterMetrics(lambda: [self.ctx_pool, self.gen_pool], served_model,
                                     lambda: guard_counts(self.connections))
        self.admission = Admission(config.max_inflight, config.max_queue_len, self._capacity)
        self.orchestrator: Orchestrator | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """One HTTP client to the workers and the health loop, for the app's lifetime."""
        config = self.config
        self.connections = getattr(app.state, "connection_guard", None)
        async with Upstream(config.connect_timeout_s, config.request_timeout_s,
                            max_connections=2 * config.max_inflight + 16,
                            headers=internal_headers(self.internal_secret)) as client:
            self.orchestrator = Orchestrator(self.ctx_pool, self.gen_pool, client, self.metrics,
                                             config.control_timeout_s)
            checker = asyncio.create_task(self._check_health(client))
            try:
                yield
            finally:
                checker.cancel()
                self.off_loop.shutdown()

    async def _check_health(self, client: Upstream) -> None:
        timeout_s = self.config.health_check_timeout_s
        while True:
            await asyncio.gather(self.ctx_pool.check(client, timeout_s),
                                 self.gen_pool.check(client, timeout_s))
            if self.prefix_index is not None:
                await self.prefix_index.poll(client, self.ctx_pool.workers, timeout_s)
            self.admission.wake()  # the workers' capacity may have grown
            await asyncio.sleep(self.config.health_check_interval_s)

    def _capacity(self) -> int | None:
        """What the workers admit at once (a request holds at most one ctx and one gen worker)."""
        known = [c for c in (self.ctx_pool.capacity, self.gen_pool.capacity) if c is not None]
        return min(known) if known else None

    def _parse(self, cls: type, raw_bytes: bytes) -> tuple:
        """The body as a request model, as the JSON object forwarded to the workers (parsed
        once: strict JSON, so whatever parses re-encodes for the next hop) and its prompt's
        block keys (cache_aware; else none)."""
        raw = parse_json(raw_bytes)
        limit, num_ids = self.max_prompt_tokens, raw_prompt_length(raw)
        if limit is not None and num_ids is not None and num_ids > limit:
            raise prompt_too_long(num_ids, limit, self.max_model_len)  # before validating it
        body = parse_model(cls, raw)
        if raw.get("disaggregated_params") is not None:
            raise InvalidRequestError("disaggregated_params is set by the router between its "
                                      "workers; clients may not send it",
                                      param="disaggregated_params")
        return body, raw, self.prompt_keys.block_keys(body) if self.prompt_keys is not None else []

    async def _admit(self, request: Request, cls: type) -> tuple:
        _check_api_key(request, self.config.api_keys)
        raw_bytes = await request.body()
        body, raw, block_keys = await self.off_loop.run_if(len(raw_bytes) > OFF_LOOP_BYTES, self._parse,
                                                           cls, raw_bytes)
        del raw_bytes
        if body.model != self.served_model:
            raise ModelNotFoundError(body.model)
        # a client that leaves while queued gives its place up at once
        await run_unless_disconnected(request, self.admission.acquire())
        return body, raw, block_keys

    async def completion(self, request: Request, cls: type, endpoint: str) -> Response:
        t_arrival = time.monotonic()
        metrics = self.metrics
        try:
            body, raw, block_keys = await self._admit(request, cls)
        except Exception as err:  # refused before reaching a worker
            metrics.requests.labels(endpoint, str(getattr(err, "status_code", 500))).inc()
            raise
        metrics.queue_time.observe(time.monotonic() - t_arrival)
        metrics.running.inc()

        def on_close() -> None:
            self.admission.release()
            metrics.running.dec()

        assert self.orchestrator is not None, "the router app is not running"
        flight = Flight(self.orchestrator, endpoint, t_arrival, on_close, block_keys)
        try:  # a streamed response closes its flight when the stream ends
            return await run_unless_disconnected(
                request, self.orchestrator.run(flight, endpoint, body, raw))
        except BaseException as exc:
            status = getattr(exc, "status_code", None)
            flight.status = str(status) if status else flight.status
            flight.close()
            raise

    def models(self, request: Request) -> Response:
        _check_api_key(request, self.config.api_keys)
        card = ModelCard(id=self.served_model, created=self.started_at)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    def ready(self) -> Response:
        """200 when at least one ctx and one gen worker are healthy; the pools either way."""
        is_ready = bool(self.ctx_pool.healthy and self.gen_pool.healthy)
        pools = {pool.role: [{"url": w.url, "healthy": w.is_healthy, "error": w.last_error,
                              "inflight": w.num_inflight, "capacity": w.capacity,
                              **self._prefix_blocks(pool, w.url)} for w in pool.workers]
                 for pool in (self.ctx_pool, self.gen_pool)}
        return JSONResponse({"ready": is_ready, **pools}, status_code=200 if is_ready else 503)

    @staticmethod
    def _prefix_blocks(pool: WorkerPool, url: str) -> dict[str, int]:
        """cache_aware: the blocks the router knows ``url`` caches."""
        index = pool.prefix_index
        return {} if index is None else {"prefix_blocks": index.num_blocks(url)}

    def metrics_page(self) -> Response:
        self.metrics.waiting.set(self.admission.num_waiting)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_router_app(config: RouterConfig, ctx_urls: tuple[str, ...], gen_urls: tuple[str, ...],
                     served_model: str, limits: LimitsConfig = LimitsConfig(),
                     max_model_len: int | None = None, internal_secret: str | None = None,
                     prompt_keys: PromptKeys | None = None) -> FastAPI:
    service = RouterService(config, ctx_urls, gen_urls, served_model, limits, max_model_len,
                            internal_secret, prompt_keys)
    app = FastAPI(title="helixserve router", lifespan=service.lifespan)
    app.add_middleware(BodyLimit, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(InternalErrors)
    install_error_handlers(app)
    install_openapi(app, ROUTER_OPERATIONS)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.completion(request, CompletionRequest, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.completion(request, ChatCompletionRequest, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return service.models(request)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        return service.ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        return service.metrics_page()

    app.state.service = service
    return app


def build_router_app_from(deploy: DeploymentConfig) -> FastAPI:
    """The router of `deploy`, its API keys from the config and ``HELIXSERVE_API_KEYS``;
    ``cache_aware``: the deployment's tokenizer, where the router runs (else token-id prompts
    only are matched)."""
    router = deploy.router.model_copy(update={"api_keys": router_api_keys(deploy.router)})
    prompt_keys = None
    if router.policy == "cache_aware":
        tokenizer = tokenizer_of(deploy.model.path, deploy.model.load_format)
        if tokenizer is None:
            logger.warning("cache_aware: no tokenizer at %s: only token-id prompts are routed by prefix",
                           deploy.model.path)
        prompt_keys = PromptKeys(tokenizer, deploy.cache.tokens_per_block)
    return build_router_app(router, deploy.ctx_urls, deploy.gen_urls, deploy.model.name,
                            deploy.limits, deploy.cache.max_model_len, deploy.security.secret, prompt_keys)
