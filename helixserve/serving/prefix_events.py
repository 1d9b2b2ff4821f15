"""A prefix-caching worker's ``GET /v1/prefix_events`` (wire format:
:mod:`helixserve.protocol.prefix_events`), read from its pool's
:class:`~helixserve.kvcache.prefix_events.PrefixEventLog` (a ctx world's: its CP group's log, of
the world running now: a restarted world has a new log, whose epoch tells the router)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from helixserve.kvcache.prefix_events import PrefixEventLog, PrefixEvents
from helixserve.protocol import InvalidRequestError
from helixserve.protocol.prefix_events import PREFIX_EVENTS_PATH, PrefixEventsAnswer


def _int_param(request: Request, name: str, lowest: int) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not lowest <= number < 1 << 63:
        raise InvalidRequestError(f"{name} must be an integer >= {lowest}, got {value[:40]!r}", param=name)
    return number


def prefix_events_answer(got: PrefixEvents, tokens_per_block: int) -> PrefixEventsAnswer:
    return PrefixEventsAnswer(epoch=got.epoch, seq=got.seq, tokens_per_block=tokens_per_block,
                              resync=got.is_resync,
                              events=[(e.seq, e.kind.value, e.key.hex()) for e in got.events],
                              blocks=[key.hex() for key in got.blocks])


def install_prefix_events(app: FastAPI, events: Callable[[], PrefixEventLog], tokens_per_block: int) -> None:
    """``GET /v1/prefix_events?since=N&max_blocks=M`` on ``app`` (internal: serving/auth.py),
    answered from the log ``events()`` returns."""

    @app.get(PREFIX_EVENTS_PATH)
    async def prefix_events(request: Request) -> Response:
        since = _int_param(request, "since", 0)
        max_blocks = _int_param(request, "max_blocks", 1)
        answer = prefix_events_answer(events().since(since, max_blocks), tokens_per_block)
        return Response(answer.model_dump_json(), media_type="application/json")
