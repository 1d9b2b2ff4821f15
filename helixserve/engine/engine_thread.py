"""The engine thread of :class:`~helixserve.engine.async_engine.AsyncEngine` (stages 2 and 3 of
its lifecycle): it drains the command inbox (add / abort / release / call), steps the core and
hands each step's tokens (and finishes, and failures) to the event loop in one call.

:class:`EngineThread` is ``AsyncEngine``'s base class: its methods run on the thread that owns
the core, and reach the event loop only through ``_call_soon`` (``_deliver`` and the futures of
the commands). The commands and :class:`EngineCoreLike` (what the thread drives) live here too.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from helixserve.engine.core import EngineStats
from helixserve.engine.request import SamplingParams
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.errors import (EngineError, EngineUnavailableError, RequestFailedError,
                                      RequestRejectedError, StepFailedError)

logger = logging.getLogger(__name__)


class EngineCoreLike(Protocol):
    """What :class:`AsyncEngine` drives: the engine driver
    (:class:`~helixserve.engine.spmd.driver.WorldDriver`, a single process's included), what a
    server composes around it (a world worker's ``WorldCore``), or an :class:`EngineCore`.

    Optional: ``failure_error(request_id) -> EngineError | None``, why a request the core
    finished with an error status failed (asked once, when its error update is delivered);
    ``add_request`` may raise an :class:`EngineError` to refuse with that cause (e.g.
    :class:`EngineUnavailableError`); a plain ``ValueError`` becomes a :class:`RequestRejectedError`.
    """

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    hold_cache: bool = False, forced_output_token_ids: Sequence[int] = ()) -> Any: ...
    def abort(self, request_id: str, error: str | None = None) -> bool: ...
    def release(self, request_id: str) -> bool: ...
    def abort_all(self, error: str) -> list[str]: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestUpdate]: ...
    def stats(self) -> EngineStats: ...


# starts a request in the core instead of ``add_request`` (e.g. a KV source's prefilled start);
# the updates it returns (first tokens) are delivered like a step's
StartFn = Callable[[Any], "list[RequestUpdate] | None"]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]
    admitted: asyncio.Future
    start: StartFn | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str
    error: str | None = None


@dataclass(slots=True)
class _Release:
    request_id: str
    released: asyncio.Future | None = None


@dataclass(slots=True)
class _Call:
    fn: Callable[[Any], Any]
    result: asyncio.Future


_STOP = object()
# internal tick: an idle engine thread's longest wait for a command (a command wakes it at once;
# the tick only bounds how late it notices a state change that posts nothing)
INBOX_TICK_S = 0.5
_ERROR_STATUSES = ("abort", "error")


class EngineThread:
    """The engine-thread half of :class:`~helixserve.engine.async_engine.AsyncEngine`, which sets
    these attributes and runs ``_run`` in its thread; see the module docstring."""

    _core: EngineCoreLike
    _inbox: queue.SimpleQueue
    _loop: asyncio.AbstractEventLoop | None
    _stats: EngineStats
    num_step_errors: int

    def _deliver(self, batch: list[tuple[str, list[int], str | None, EngineError | None, int | None]]) -> None:
        """Runs on the event loop: hand each request's tokens to its reader (AsyncEngine's)."""
        raise NotImplementedError

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _resolve(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None
                 ) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        self._call_soon(settle)

    def _run(self) -> None:
        is_stopping = False
        while not is_stopping:
            is_idle = not self._core.has_unfinished_requests()
            commands = self._drain(block=is_idle)
            for command in commands:
                if command is _STOP:
                    is_stopping = True
                else:
                    self._apply(command)
            if not is_stopping and self._core.has_unfinished_requests():
                self._step()
            self._stats = self._core.stats()
        failed = self._core.abort_all("the server is shutting down")
        error = EngineUnavailableError("the server is shutting down")
        self._call_soon(self._deliver, [(rid, [], None, error, None) for rid in failed])
        self._drain_adds_after_stop(error)

    def _drain(self, block: bool) -> list[Any]:
        commands = []
        try:
            commands.append(self._inbox.get(timeout=INBOX_TICK_S) if block else self._inbox.get_nowait())
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _drain_adds_after_stop(self, error: EngineError) -> None:
        for command in self._drain(block=False):
            if isinstance(command, _Add):
                self._resolve(command.admitted, error=error)
            elif isinstance(command, _Release) and command.released is not None:
                self._resolve(command.released, False)
            elif isinstance(command, _Call):
                self._resolve(command.result, error=error)

    def _apply(self, command: _Add | _Abort | _Release | _Call) -> None:
        if isinstance(command, _Add):
            try:
                if command.start is None:
                    self._core.add_request(command.request_id, command.prompt_token_ids,
                                           command.params, **command.kwargs)
                    updates = None
                else:
                    updates = command.start(self._core)
            except EngineError as exc:  # the core refused it with a cause of its own
                self._resolve(command.admitted, error=exc)
            except ValueError as exc:
                self._resolve(command.admitted, error=RequestRejectedError(str(exc)))
            except Exception as exc:  # a start function failed unexpectedly
                logger.exception("starting request %s failed", command.request_id)
                self._resolve(command.admitted, error=RequestFailedError(
                    f"starting request {command.request_id} failed: {type(exc).__name__}: {exc}"))
            else:
                self._resolve(command.admitted)
                if updates:
                    self._dispatch(updates)
        elif isinstance(command, _Abort):
            self._core.abort(command.request_id, command.error)
        elif isinstance(command, _Call):
            try:
                self._resolve(command.result, command.fn(self._core))
            except Exception as exc:  # the caller's function failed: tell the caller
                self._resolve(command.result, error=exc)
        else:
            released = self._core.release(command.request_id)
            if command.released is not None:
                self._resolve(command.released, released)

    def _step(self) -> None:
        try:
            updates = self._core.step()
        except Exception as exc:  # the model or a kernel raised: fail this step's requests
            self.num_step_errors += 1
            logger.exception("engine step failed")
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            failed = self._core.abort_all(message)
            error = StepFailedError(message)
            self._call_soon(self._deliver, [(rid, [], None, error, None) for rid in failed])
            return
        if any(u.error is not None for u in updates):  # the core failed the step's requests itself
            self.num_step_errors += 1
        self._dispatch(updates)

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        """Hand new tokens (and finishes) to the event loop, one call for all requests."""
        batch: dict[str, tuple[str, list[int], str | None, EngineError | None, int | None]] = {}
        for update in updates:
            rid, tokens, _, _, cached = batch.setdefault(update.request_id, (update.request_id, [], None, None, None))
            reason, error = update.status.finish_reason, None
            if reason in _ERROR_STATUSES:  # failed inside the core (a KV transfer, a step): no token
                error = self._failure_error(rid, reason, update.error)
                reason = None
            else:
                tokens.append(update.token_id)
            batch[rid] = (rid, tokens, reason, error,
                          update.num_cached_tokens if update.num_cached_tokens is not None else cached)
        if batch:
            self._call_soon(self._deliver, list(batch.values()))

    def _failure_error(self, request_id: str, reason: str, step_error: str | None) -> EngineError:
        """The error of a request the core failed: the core's own (``failure_error(request_id)``,
        e.g. which KV transfer failed and why) where it has one, else an error naming the failed
        step's exception (``step_error``, a :class:`StepFailedError`) or a generic one."""
        explain = getattr(self._core, "failure_error", None)
        error = explain(request_id) if explain is not None else None
        if error is None and step_error is not None:
            return StepFailedError(step_error)
        return error or RequestFailedError(f"request {request_id} failed in the engine ({reason})")
