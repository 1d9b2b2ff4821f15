"""Stage 3 of the ctx worker: prefills whose cache stays allocated until the gen side picks it up.

A request is registered (:meth:`PickupRegistry.hold`) *before* its prefill, marked ready with its
first token(s) once prefilled, then offered to the ctx worker's KV sender
(:mod:`helixserve.ctx_server.transfer`, ``is_offered``). From then on the sender owns its end: it
frees the cache when every expected gen rank acknowledged, on cancel, or at its pickup deadline,
and only when no send can still read the blocks; :meth:`PickupRegistry.freed` then releases the
engine's hold. A hold never offered (no sender) is freed by :meth:`release` (the router's
``POST /v1/release``) or, past ``now + timeout_s``, by :meth:`expire_due` (counted in
``num_expired``): a hold is never unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from helixserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HeldPrefill:
    request_id: str
    prompt_token_ids: list[int]
    deadline: float  # clock() time after which a ready hold's cache is freed
    first_gen_tokens: list[int] = field(default_factory=list)  # empty while prefilling
    is_offered: bool = False  # the KV sender holds it: it decides when the cache is freed
    is_cancelled: bool = False  # the client left while it was being offered

    @property
    def is_ready(self) -> bool:
        """Prefilled: the cache holds the whole prompt and the first token is known."""
        return bool(self.first_gen_tokens)


class PickupRegistry:
    """Held prefills by request id (the engine's request id, sent as ``ctx_request_id``)."""

    def __init__(self, engine: AsyncEngine, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"pickup timeout must be > 0 s, got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s  # for holds not offered to a sender
        self.clock = clock
        self._held: dict[str, HeldPrefill] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_released = 0
        self.num_expired = 0

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, prompt_token_ids: list[int]) -> HeldPrefill:
        """Register a request *before* its prefill runs (so no path can leave its cache held
        without a deadline); :meth:`mark_ready` once the first token is known. ``ValueError`` if
        the id is held already (the holder's entry is left as it is)."""
        if request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already held here")
        held = HeldPrefill(request_id, list(prompt_token_ids), self.clock() + self.timeout_s)
        self._held[request_id] = held
        return held

    def mark_ready(self, request_id: str, first_gen_tokens: list[int]) -> None:
        """The prefill finished and its cache is held: the pickup deadline starts now."""
        held = self._held.get(request_id)
        if held is not None:
            held.first_gen_tokens = list(first_gen_tokens)
            held.deadline = self.clock() + self.timeout_s

    def get(self, request_id: str) -> HeldPrefill | None:
        return self._held.get(request_id)

    async def release(self, request_id: str) -> bool:
        """Free a held cache (picked up or cancelled); False if not held here (any more)."""
        if self._held.pop(request_id, None) is None:
            return False
        await self.engine.release(request_id)
        self.num_released += 1
        return True

    async def freed(self, request_id: str) -> None:
        """The KV sender freed an offered hold (acknowledged, cancelled or expired, and
        quiesced): release the engine's hold, whatever the registry still knows of it."""
        self._held.pop(request_id, None)
        if await self.engine.release(request_id):
            self.num_released += 1

    def release_threadsafe(self, request_id: str) -> None:
        """:meth:`release` from another thread (the transceiver's control plane)."""
        if self._loop is None:
            raise RuntimeError("the pickup registry is not running")
        asyncio.run_coroutine_threadsafe(self.release(request_id), self._loop)

    def forget(self, request_id: str) -> None:
        """The request was aborted (the engine freed its cache already)."""
        self._held.pop(request_id, None)

    async def expire_due(self) -> list[str]:
        """Free every prefilled hold past its deadline; returns their ids. (A request still
        prefilling is its handler's to clean up: it forgets it on failure or cancel.)"""
        now = self.clock()
        due = [rid for rid, held in self._held.items()
               if held.is_ready and not held.is_offered and held.deadline <= now]
        for rid in due:
            del self._held[rid]
            if not await self.engine.release(rid):
                continue  # freed otherwise meanwhile (aborted)
            self.num_expired += 1
            logger.warning("ctx request %s: not picked up within %.1f s, cache freed", rid,
                           self.timeout_s)
        return due

    @contextlib.asynccontextmanager
    async def running(self, interval_s: float = 0.5) -> AsyncIterator[PickupRegistry]:
        """Expire holds every ``interval_s`` while the context is open; free all on exit."""
        self._loop = asyncio.get_running_loop()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(interval_s)
                await self.expire_due()

        task = asyncio.create_task(sweep())
        try:
            yield self
        finally:
            task.cancel()
            for rid in list(self._held):
                await self.release(rid)
            self._loop = None

    def gauges(self, num_expired_by_sender: int = 0) -> list[tuple[str, str, float]]:
        return [
            ("pickups_held", "prefills holding their cache for pickup", self.num_held),
            ("pickups_released_total", "holds freed (picked up, cancelled or expired)",
             self.num_released),
            ("pickups_expired_total", "holds freed at the pickup deadline",
             self.num_expired + num_expired_by_sender),
        ]
