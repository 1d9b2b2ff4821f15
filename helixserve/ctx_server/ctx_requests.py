"""The ctx requests' life on the engine thread: :class:`CtxRequests` applies every event of
:class:`~helixserve.ctx_server.lifecycle.CtxRequestLife` there, together with the engine
operation it implies, so that the table and the scheduler's holds move as one.

- :meth:`CtxRequests.generate`: admission (``Admitted`` then ``core.add_request`` with the cache
  held on finish, in one engine-thread call; a duplicate id is refused before the engine sees it).
- :meth:`CtxRequests.prefilled`: ``Prefilled``, then ``Finished`` (a request finished at its first
  token) or the KV sender's hold and ``Offered``, in one engine-thread call.
- :meth:`CtxRequests.request` / :meth:`post`: any other event, from the event loop (awaited) or
  from any thread (the KV sender's ``on_free``, a failing handler; applied soon, in order).
- A transition that leaves HELD or SENDING for RELEASED releases the engine's hold right there.
- :meth:`running`: expires HELD entries past their deadline every ``interval_s`` and stops (frees)
  whatever is left on exit. A hold is never unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from helixserve.clock import Clock, MonotonicClock
from helixserve.ctx_server.lifecycle import (Admitted, CtxRequestLife, CtxState, Event, Expired,
                                             Finished, IllegalTransitionError, Offered, Prefilled,
                                             ReleaseCause, Stopped, Transition)
from helixserve.engine.async_engine import AsyncEngine, RequestOutput
from helixserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)

# internal tick: how often held prefills are checked against their deadline (the deadline itself is
# ctx[].pickup_timeout_s; a hold is freed at most one tick after it)
EXPIRY_TICK_S = 0.5

OfferFn = Callable[[Any], None]  # engine thread: hand the held request to the KV sender


class CtxRequests:
    """Every ctx request's state (one :class:`CtxRequestLife`), moved on ``engine``'s thread."""

    def __init__(self, engine: AsyncEngine, timeout_s: float,
                 clock: Clock | None = None) -> None:
        self.engine = engine
        self.life = CtxRequestLife(timeout_s, clock or MonotonicClock())
        # admission tokens start at random, so a release meant for a worker before its restart
        # names no admission of this one
        self._tokens = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_live(self) -> int:
        return self.life.num_live

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
                 ) -> tuple[int, AsyncIterator[RequestOutput]]:
        """``(token, outputs)`` of a ``context_only`` prefill; the token names this admission in
        later events. The outputs raise :class:`DuplicateRequestError` (400) for a live id."""
        token, prompt = next(self._tokens), list(prompt_token_ids)

        def start(core: Any) -> None:
            self._apply(core, Admitted(request_id, token))
            try:
                core.add_request(request_id, prompt, params, hold_cache=True)
            except BaseException:
                self._apply(core, Finished(request_id, token, ReleaseCause.REFUSED))
                raise

        return token, self.engine.generate(request_id, prompt, params, hold_cache=True, start=start)

    async def prefilled(self, request_id: str, token: int, first_gen_tokens: Sequence[int],
                        offer: OfferFn | None) -> CtxState:
        """The prefill finished: SENDING once ``offer(core)`` handed it to the KV sender, or
        RELEASED (``offer`` None: finished at its first token; or cancelled while prefilling).
        If ``offer`` raises, the hold is freed and the error re-raised."""

        def step(core: Any) -> CtxState:
            moved = self._apply(core, Prefilled(request_id, token, tuple(first_gen_tokens)))
            if moved.after is not CtxState.HELD:
                return CtxState.RELEASED
            if offer is None:
                return self._apply(core, Finished(request_id, token, ReleaseCause.FINISHED)).after
            try:
                offer(core)
            except Exception:
                self._apply(core, Finished(request_id, token, ReleaseCause.OFFER_FAILED))
                raise
            return self._apply(core, Offered(request_id, token)).after

        return await self.engine.call(step)

    async def request(self, event: Event) -> Transition:
        """Apply ``event`` on the engine thread (from the event loop) and return its move."""
        return await self.engine.call(lambda core: self._apply(core, event))

    def post(self, event: Event) -> None:
        """Apply ``event`` on the engine thread soon (any thread; in posting order per thread)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._spawn, event)
        except RuntimeError:  # the loop closed: running()'s exit stopped every entry
            pass

    async def expire_due(self) -> list[str]:
        """Free every HELD entry past its deadline; returns their ids."""

        def expire(core: Any) -> list[str]:
            return [self._apply(core, Expired(rid)).request_id for rid in self.life.due()]

        return await self.engine.call(expire)

    @contextlib.asynccontextmanager
    async def running(self, interval_s: float = EXPIRY_TICK_S) -> AsyncIterator[CtxRequests]:
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
            for pending in list(self._tasks):
                pending.cancel()
            with contextlib.suppress(Exception):
                await self.engine.call(lambda core: [self._apply(core, Stopped(rid))
                                                     for rid in list(self.life.entries)])
            self._loop = None

    def gauges(self, num_expired_by_sender: int = 0) -> list[tuple[str, str, float]]:
        return [
            ("pickups_held", "ctx requests prefilling or holding their cache for its gen worker", self.num_live),
            ("pickups_released_total", "holds freed (picked up, cancelled or expired)",
             self.life.num_released),
            ("pickups_expired_total", "holds freed at the hold deadline",
             self.life.num_expired + num_expired_by_sender),
        ]

    # -- engine thread ---------------------------------------------------------------------

    def _apply(self, core: Any, event: Event) -> Transition:
        moved = self.life.apply(event)
        if moved.frees_held_cache and not core.release(moved.request_id):
            logger.error("ctx request %s: %s, but the engine held no cache for it", moved.request_id,
                         moved.cause.value if moved.cause else "released")
        if moved.cause is ReleaseCause.EXPIRED:
            logger.warning("ctx request %s: not offered within %.1f s, cache freed", moved.request_id,
                           self.life.timeout_s)
        return moved

    # -- event loop ------------------------------------------------------------------------

    def _spawn(self, event: Event) -> None:
        task = asyncio.get_running_loop().create_task(self._apply_posted(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply_posted(self, event: Event) -> None:
        try:
            await self.request(event)
        except IllegalTransitionError as exc:
            logger.error("%s", exc)
        except Exception as exc:  # noqa: BLE001 - the engine stopped: running()'s exit frees all
            logger.debug("ctx event %s not applied: %s", event, exc)
