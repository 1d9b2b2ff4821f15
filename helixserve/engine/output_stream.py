"""What a request's reader receives from :class:`~helixserve.engine.async_engine.AsyncEngine`:
:class:`RequestOutput` s, built from a :class:`RequestStream` (the tokens the engine thread handed
over that the reader has not taken yet) and an :class:`IncrementalDetokenizer` (their text)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from helixserve.engine.stop import truncate_at_stop
from helixserve.engine.errors import EngineError

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing token list whose concatenation is the final text.

    The final text is ``truncate_at_stop(decode(all tokens), stop)``. While unfinished, a trailing
    ``U+FFFD`` run (bytes that may still become a character) and the last ``max(len(stop)) - 1``
    characters (the start of a stop string) are held back; everything before them can no longer
    change. Each call decodes the whole output (the decoder is Rust; fine for serving lengths).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._num_emitted = 0
        self.text = ""  # emitted so far

    def add(self, token_ids: Sequence[int], is_finished: bool) -> str:
        """Append tokens; the newly stable text (everything left, cut at a stop, when finished)."""
        self._token_ids.extend(token_ids)
        text = truncate_at_stop(self._decode(self._token_ids), self._stop)
        end = len(text) if is_finished else len(text.rstrip(_REPLACEMENT)) - self._hold
        if end <= self._num_emitted:
            return ""
        delta = text[self._num_emitted:end]
        self._num_emitted = end
        self.text += delta
        return delta


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since the last output."""

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int  # all so far
    finish_reason: str | None = None  # "stop" or "length" on the last output
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: no caching)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestStream:
    """Tokens of one request the reader has not taken yet (merged: one pending item at most)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: EngineError | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    num_cached_tokens: int | None = None

    def put(self, token_ids: list[int], finish_reason: str | None, error: EngineError | None,
            num_cached_tokens: int | None = None) -> None:
        self.token_ids.extend(token_ids)
        if num_cached_tokens is not None:
            self.num_cached_tokens = num_cached_tokens
        self.finish_reason = self.finish_reason or finish_reason
        self.error = self.error or error
        self.event.set()

    async def take(self) -> tuple[list[int], str | None, EngineError | None]:
        await self.event.wait()
        self.event.clear()
        token_ids, self.token_ids = self.token_ids, []
        return token_ids, self.finish_reason, self.error

