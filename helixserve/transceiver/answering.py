"""Bounded answers from a thread that owns all the state: a gRPC handler asks the owner thread to
run a command and waits at most twice the RPC timeout, never leaving a half-known outcome."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

Reply = TypeVar("Reply")


def answer_within(call: Callable[..., Future], fn: Callable[[Any], Reply], request: Any, busy_reply: Reply,
                  timeout_s: float, undo: Callable[[Reply], None] | None = None) -> Reply:
    """``fn(request)`` run by ``call`` (which queues it on the owner thread), or ``busy_reply``.

    A command not started within ``timeout_s`` is answered busy and never runs later (a late
    accepted shard would send to a gen that gave up). One that started is waited for once more;
    if that wait runs out too, the caller is answered busy and ``undo(reply)`` runs on the owner
    thread right after ``fn`` (the same command, so nothing happened in between): "busy" always
    means "no effect".
    """
    lock, state = threading.Lock(), {"started": False, "abandoned": False, "done": False}

    def run_unless_abandoned(req: Any) -> Reply:
        with lock:
            if state["abandoned"]:
                return busy_reply
            state["started"] = True
        reply = fn(req)
        with lock:
            state["done"] = True
            if state["abandoned"] and undo is not None:
                undo(reply)
        return reply

    future = call(run_unless_abandoned, request)
    for is_last_wait in (False, True):
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            with lock:
                if not state["done"] and (is_last_wait or not state["started"]):
                    state["abandoned"] = True
                    return busy_reply
    return future.result(timeout=timeout_s)  # it finished just as the last wait ran out
