"""A worker's warm-up: a few short greedy requests through its real engine path before ``/ready``.

1. The app's lifespan starts the engine and the role's hooks, then :meth:`WarmUp.start` runs the
   warm-up as a task while uvicorn serves: ``/health`` answers 200 (alive), ``/ready`` 503
   ``warming up`` (the router sends nothing to a worker that is not ready).
2. The requests (:func:`warm_up_prompts`), one after the other: a prompt one token longer than
   the larger of a cache page and the prefill chunk budget (so the prefill runs over a page
   boundary and, where the context length allows, in two chunks), then a short one (a page + 1),
   a medium one (8 pages + 1) and 8 whole pages, alone and as :data:`BATCH` requests at once
   (Triton specializes each integer argument apart: a length divisible by 16 with one sequence
   is its own case); each then runs :data:`NUM_DECODE_STEPS` greedy decode steps.
   They go through the worker's ``AsyncEngine`` (a gen world: every rank, through its driver); a
   ctx worker holds its cache at the finish and releases it, as a gen worker's fetch would. Kernels compile
   (Triton, fla) and first-step costs are paid here, not by the first client. Several lengths,
   because kernels specialize and autotune on length classes: fla's ``l2norm_fwd`` autotunes
   25 configurations per ``cdiv(tokens * heads, 65536)``, and Triton specializes integer
   arguments equal to 1 or divisible by 16 (a block table of 8 pages is not one of 9). With the
   long prompt alone the first short request paid 9-10 s of autotuning on a fresh H200 (1.2 s
   with a warm Triton cache); without the whole-page prompt a 512-token prompt compiled 1.1 s.
3. The warm-up checks that it left nothing allocated (blocks, slots, held requests).
4. Done: ``/ready`` 200. Failed: ``/health`` and ``/ready`` 503 naming the cause, and the worker
   stops itself (SIGTERM: uvicorn's graceful shutdown); its command exits 1 naming the cause.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from helixserve.config import DeploymentConfig
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.request import SamplingParams
from helixserve.serving.openai_serving import ServingLimits
from helixserve.serving.shutdown import stop_this_process

logger = logging.getLogger(__name__)

NUM_DECODE_STEPS = 4
SETTLE_S = 2.0  # internal: how long the engine may take to free the warm-up's cache after it ended
SETTLE_TICK_S = 0.01  # internal: how often it is asked meanwhile
_PRIME = 7919  # spreads the prompt's ids over the vocabulary, deterministically


class WarmUpState(enum.Enum):
    PENDING = "pending"  # the server starts
    WARMING = "warming up"
    DONE = "done"
    FAILED = "failed"
    OFF = "off"  # warm_up: false


BATCH = 4  # the last warm-up prompt runs as this many requests at once (batched prefill and decode)


def warm_up_prompts(max_model_len: int, max_prompt_tokens: int, vocab: int, tokens_per_block: int,
                    max_num_batched_tokens: int) -> list[tuple[list[int], SamplingParams, int]]:
    """Every warm-up step, in order (see the module docstring): ``(prompt, params, copies)``
    (from the bare numbers: a restarted gen world's driver has no serving limits)
    for ``max(page, chunk) + 1``, ``page + 1``, ``8 * page + 1`` and ``8 * page`` prompt tokens,
    the last alone and then as :data:`BATCH` requests at once; each length clipped so that
    prompt + decode steps fit the context length, a step that repeats an earlier one left out."""
    room = max(1, min(max_prompt_tokens, max_model_len - NUM_DECODE_STEPS - 1))
    steps: list[tuple[int, int]] = []
    for wanted, copies in ((max(tokens_per_block, max_num_batched_tokens) + 1, 1), (tokens_per_block + 1, 1),
                           (8 * tokens_per_block + 1, 1), (8 * tokens_per_block, 1), (8 * tokens_per_block, BATCH)):
        if (n := max(1, min(wanted, room)), copies) not in steps:  # a clipped batch step stays a batch
            steps.append((n, copies))
    params = SamplingParams(max_tokens=NUM_DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    return [([1 + (i * _PRIME) % (vocab - 1) for i in range(n)] if vocab > 1 else [0] * n, params, copies)
            for n, copies in steps]


class WarmUp:
    """One worker's warm-up and its outcome (``/ready`` and ``/health`` read :meth:`failure` and
    :meth:`not_ready_cause`). ``is_enabled`` False: ready as soon as the server is."""

    def __init__(self, role: str, is_enabled: bool = True, hold_cache: bool = False,
                 tokens_per_block: int = 16, max_num_batched_tokens: int = 2048, num_requests: int = 1,
                 on_failure: Callable[[], None] = stop_this_process,
                 *, timeout_s: float) -> None:
        self.role = role
        self.num_requests = num_requests  # at once: a gen world of dp groups gets one per group
        self.hold_cache = hold_cache  # a ctx worker: held at the finish, then released
        self.tokens_per_block = tokens_per_block
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.state = WarmUpState.PENDING if is_enabled else WarmUpState.OFF
        self.cause: str | None = None  # why it failed
        self.seconds: float | None = None
        self.num_prompt_tokens = 0  # the longest warm-up prompt
        self.prompt_lengths: list[int] = []
        self._task: asyncio.Task | None = None

    @classmethod
    def for_deployment(cls, role: str, deploy: DeploymentConfig, is_enabled: bool, timeout_s: float,
                       hold_cache: bool = False, num_requests: int = 1) -> WarmUp:
        """Sized by the deployment's page and prefill chunk budget (``EngineCore`` raises the
        budget to ``max_num_seqs``)."""
        chunk = max(deploy.scheduler.max_num_batched_tokens, deploy.cache.max_num_seqs)
        return cls(role, is_enabled, hold_cache, deploy.cache.tokens_per_block, chunk, num_requests,
                   timeout_s=timeout_s)

    @property
    def exit_code(self) -> int | None:
        """1 once the warm-up failed (the worker's command exits with it), else None."""
        return 1 if self.state is WarmUpState.FAILED else None

    def failure(self) -> str | None:
        """Why the worker cannot serve because of its warm-up (it failed), or None."""
        return f"its warm-up failed: {self.cause}" if self.state is WarmUpState.FAILED else None

    def not_ready_cause(self) -> str | None:
        """Why ``/ready`` answers 503 because of the warm-up, or None."""
        if self.state in (WarmUpState.PENDING, WarmUpState.WARMING):
            return "warming up"
        return self.failure()

    def describe(self) -> dict[str, Any]:
        return {"state": self.state.value, "seconds": self.seconds,
                "num_prompt_tokens": self.num_prompt_tokens, "prompt_lengths": self.prompt_lengths,
                "cause": self.cause}

    def start(self, engine: AsyncEngine, limits: ServingLimits) -> None:
        """On the event loop, once the engine runs: warm up in a task (no-op when off)."""
        if self.state is not WarmUpState.PENDING:
            return
        self.state = WarmUpState.WARMING
        self._task = asyncio.get_running_loop().create_task(self._run(engine, limits),
                                                            name=f"{self.role}-warm-up")

    async def stop(self) -> None:
        """Cancel a warm-up still running (the worker is shutting down)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self, engine: AsyncEngine, limits: ServingLimits) -> None:
        prompts = warm_up_prompts(limits.max_model_len, limits.max_prompt_tokens, limits.vocab_size,
                                  self.tokens_per_block, self.max_num_batched_tokens)
        self.num_prompt_tokens = max(len(p) for p, _, _ in prompts)
        self.prompt_lengths = [len(p) for p, _, _ in prompts]
        began = time.perf_counter()
        logger.info("%s worker warming up: %d request(s) each of %s prompt tokens, %d decode steps",
                    self.role, self.num_requests, " then ".join(map(str, self.prompt_lengths)), NUM_DECODE_STEPS)
        try:
            await asyncio.wait_for(self._all(engine, prompts), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means this worker cannot serve
            is_timeout = isinstance(exc, TimeoutError)
            self.cause = f"it took over {self.timeout_s:g} s" if is_timeout else f"{type(exc).__name__}: {exc}"
            self.state = WarmUpState.FAILED
            logger.error("%s worker: %s; stopping (exit code 1)", self.role, self.failure())
            self.on_failure()
            return
        self.seconds = time.perf_counter() - began
        self.state = WarmUpState.DONE
        logger.info("%s worker warmed up in %.2f s: ready", self.role, self.seconds)

    async def _all(self, engine: AsyncEngine, prompts: list[tuple[list[int], SamplingParams, int]]) -> None:
        for prompt, params, copies in prompts:
            await self._requests(engine, prompt, params, copies)

    async def _requests(self, engine: AsyncEngine, prompt: list[int], params: SamplingParams, copies: int = 1) -> None:
        await asyncio.gather(*(self._request(engine, prompt, params) for _ in range(self.num_requests * copies)))
        # an overlapped engine frees a finished request's cache when it collects the step already
        # in flight behind its last token: ask until that happened (the caller's timeout bounds it)
        settle_end = time.perf_counter() + SETTLE_S
        while True:
            stats = await engine.call(lambda core: core.stats())
            left = {name: getattr(stats, name) for name in ("num_running", "num_waiting", "num_held",
                                                             "num_used_blocks", "num_used_slots")}
            if not any(left.values()):
                return
            if time.perf_counter() >= settle_end:
                raise RuntimeError(f"the warm-up left cache allocated: {left}")
            await asyncio.sleep(SETTLE_TICK_S)

    async def _request(self, engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> None:
        rid = engine.new_request_id(f"{self.role}-warm-up")
        num_tokens = 0
        async for out in engine.generate(rid, prompt, params, hold_cache=self.hold_cache):
            num_tokens = out.num_output_tokens
        if num_tokens < 1:
            raise RuntimeError("the warm-up request generated no token")
        if self.hold_cache and not await engine.release(rid):
            raise RuntimeError(f"the warm-up request {rid} was not held at its finish")
