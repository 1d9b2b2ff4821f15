"""Asyncio front of the engine: one thread owns the :class:`EngineCore` and runs its step loop;
coroutines submit requests and read text deltas.

A request's stages here:

1. ``generate()`` admits it: at most ``max_num_seqs + max_queue_len`` live requests, else
   :class:`EngineQueueFullError`. An ADD command goes to the engine thread's inbox.
2. The engine thread (:mod:`helixserve.engine.engine_thread`) drains its inbox (add / abort /
   release), then steps the core. An add the core refuses (``ValueError``: too long, bad ids)
   comes back to ``generate()`` as a :class:`RequestRejectedError`.
3. After each step the new tokens of every request go to the event loop in one call; a request's
   :class:`RequestStream` merges tokens its reader has not taken yet (one pending item per
   request, so memory is bounded whatever the reader's speed).
4. ``generate()`` turns tokens into text with :class:`IncrementalDetokenizer` (no broken UTF-8,
   stop strings held back and cut) and yields :class:`RequestOutput` s; the last one has
   ``finish_reason``. These three live in :mod:`helixserve.engine.output_stream`.
5. Leaving the iterator early (client gone, task cancelled) aborts the request in the engine,
   which frees its cache (a request the core refused sends no abort: its id may be another
   request's, e.g. a held prefill's); a ``hold_cache`` request that finished stays held until ``release()``.

Failures never hang a reader: a step that fails ends the requests it concerns with a
:class:`StepFailedError` naming the exception (the core reports them as error updates; a core whose
``step()`` raises instead has every unfinished request failed); the loop goes on. ``shutdown()``
fails what is left with an :class:`EngineUnavailableError`. Every error is one of
:mod:`helixserve.engine.errors`; the servers map them to HTTP (``serving.engine_errors``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from helixserve.config import ShutdownConfig
from helixserve.engine.core import EngineStats
from helixserve.engine.engine_thread import (_STOP, EngineCoreLike, EngineThread, StartFn, _Abort, _Add, _Call,
                                             _Release)
from helixserve.engine.output_stream import IncrementalDetokenizer, RequestOutput, RequestStream
from helixserve.engine.request import SamplingParams
from helixserve.engine.errors import (DuplicateRequestIdError, EngineError, EngineQueueFullError,
                                      EngineUnavailableError, RequestAbortedError)

logger = logging.getLogger(__name__)

_SHUTDOWN = ShutdownConfig()  # the default of shutdown()'s grace (config.py)
# internal waits of shutdown (the bound on live requests is the caller's ``grace_s``)
DRAIN_TICK_S = 0.05  # how often a shutdown checks whether the live requests finished
THREAD_JOIN_S = 30.0  # the engine thread finishes the step in progress (a stuck step: logged, left)


class AsyncEngine(EngineThread):
    """Runs ``core`` in a thread named ``engine_thread_name``; see the module docstring.

    Args:
        core: the engine; only the engine thread touches it after :meth:`start`.
        decode: token ids -> text (``None``: outputs carry ids and empty text).
        max_num_seqs: running slots of ``core`` (admission limit = this + ``max_queue_len``).
        max_queue_len: requests allowed to wait beyond the running slots.
    """

    def __init__(self, core: EngineCoreLike, decode: Callable[[list[int]], str] | None,
                 max_num_seqs: int, max_queue_len: int, engine_thread_name: str = "engine") -> None:
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self._core = core
        self._decode = decode or (lambda ids: "")
        self.capacity = max_num_seqs + max_queue_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=engine_thread_name, daemon=True)
        self._is_accepting = False
        self._stats = core.stats()
        self.num_step_errors = 0

    # -- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read outputs."""
        self._loop = asyncio.get_running_loop()
        self._is_accepting = True
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._is_accepting and self._thread.is_alive()

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its last step."""
        return self._stats

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is admitted here and not finished."""
        return request_id in self._streams

    def new_request_id(self, prefix: str = "req") -> str:
        """An id nobody can guess (128 random bits): a request's id names its cache to the KV
        transfer, so it must not be derivable from another's."""
        return f"{prefix}-{secrets.token_hex(16)}"

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, hold_cache: bool = False, forced_output_token_ids: Sequence[int] = (),
                       start: StartFn | None = None) -> AsyncIterator[RequestOutput]:
        """Run one request; yields outputs until the one with ``finish_reason``.

        ``start(core)``, when given, replaces ``core.add_request`` on the engine thread (a KV
        source starting a request whose prompt state it put in the cache, e.g. through
        ``core.add_prefilled_request``); the updates it returns are this request's first outputs.

        Raises an :class:`EngineError`: :class:`EngineQueueFullError`, :class:`RequestRejectedError`
        (the core refused it; :class:`DuplicateRequestIdError` for a live id),
        :class:`EngineUnavailableError` (shutting down, or the core's own cause),
        :class:`RequestFailedError` / :class:`StepFailedError` (the engine failed), a core's own
        :class:`EngineError` (e.g. :class:`KVTransferError`) or :class:`RequestAbortedError`
        (aborted through :meth:`abort`).
        """
        stream = self._admit(request_id)
        admitted = asyncio.get_running_loop().create_future()
        kwargs = {"hold_cache": hold_cache, "forced_output_token_ids": tuple(forced_output_token_ids)}
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, kwargs, admitted, start))
        detok = IncrementalDetokenizer(self._decode, params.stop)
        num_output = 0
        is_finished = is_refused = False
        try:
            try:
                await admitted
            except EngineError:
                is_refused = True  # the core never took it: its id may be another request's
                raise
            while not is_finished:
                token_ids, finish_reason, error = await stream.take()
                if error is not None:
                    raise error
                is_finished = finish_reason is not None
                num_output += len(token_ids)
                text = detok.add(token_ids, is_finished)
                if is_finished:  # no longer live, even if the reader never resumes us
                    self._forget(request_id, stream)
                yield RequestOutput(request_id, token_ids, text, len(prompt_token_ids), num_output,
                                    finish_reason, stream.num_cached_tokens)
        finally:
            if self._forget(request_id, stream) and not (is_finished or is_refused):
                self._inbox.put(_Abort(request_id))  # cancelled or left early: free the cache

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Abort a request (a held one too); its reader gets :class:`RequestAbortedError`."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put([], None, RequestAbortedError(error or f"request {request_id} was aborted",
                                                     request_id=request_id))
        self._inbox.put(_Abort(request_id, error))

    async def release(self, request_id: str) -> bool:
        """Free a held request's cache; False when it is not held (never was, or already freed)."""
        released = asyncio.get_running_loop().create_future()
        self._inbox.put(_Release(request_id, released))
        return await released

    async def call(self, fn: Callable[[EngineCoreLike], Any]) -> Any:
        """Run ``fn(core)`` on the engine thread between steps and return its result (e.g. the
        transceiver reading a held request's block table); its exception is re-raised here."""
        result = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, result))
        return await result

    async def shutdown(self, grace_s: float = _SHUTDOWN.requests_grace_s) -> None:
        """Refuse new requests, let live ones finish for up to ``grace_s`` (a server passes its
        ``shutdown.requests_grace_s``; the default is that field's), then stop the thread and fail what is left with an
        :class:`EngineUnavailableError`."""
        self._is_accepting = False
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(DRAIN_TICK_S)
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, THREAD_JOIN_S)

    def _admit(self, request_id: str) -> RequestStream:
        if not self.is_alive:
            raise EngineUnavailableError("the engine is not running (shutting down or failed)")
        if request_id in self._streams:
            raise DuplicateRequestIdError(f"request id {request_id!r} is already running here",
                                          request_id=request_id)
        if len(self._streams) >= self.capacity:
            raise EngineQueueFullError(len(self._streams), self.capacity)
        stream = self._streams[request_id] = RequestStream()
        return stream

    def _forget(self, request_id: str, stream: RequestStream) -> bool:
        """Drop ``stream`` if it is still the live one of ``request_id``."""
        if self._streams.get(request_id) is not stream:
            return False
        del self._streams[request_id]
        return True

    def _deliver(self, batch: list[tuple[str, list[int], str | None, EngineError | None, int | None]]) -> None:
        for request_id, token_ids, finish_reason, error, num_cached in batch:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(token_ids, finish_reason, error, num_cached)
