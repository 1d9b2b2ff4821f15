"""Hostile phases of ``bench/soak.py``: slow and idle connections held while the clients run
(slowloris), and large bodies refused in each of the ways a deployment refuses them, with each
process's RSS around every case."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlparse

from _common import markdown_table


async def _hold(host: str, port: int, end: float, is_slow: bool) -> bool:
    """One connection that never completes a request: nothing at all (idle) or a header line
    every second (slow headers). True when the server closed it before ``end``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    try:
        if is_slow:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n")
        while time.monotonic() < end:
            if is_slow:
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(65536), 1.0) == b"":
                    return True
            except asyncio.TimeoutError:
                continue
        return False
    except (ConnectionError, OSError):
        return True
    finally:
        writer.close()


async def slowloris(url: str, num_idle: int, num_slow: int, end: float) -> dict:
    """``num_idle`` idle and ``num_slow`` slow-header connections to ``url`` until ``end``."""
    parsed = urlparse(url)
    kinds = [False] * num_idle + [True] * num_slow
    closed = await asyncio.gather(*(_hold(parsed.hostname, parsed.port, end, slow) for slow in kinds))
    return {"idle": num_idle, "slow_header": num_slow,
            "idle_closed_by_server": sum(c for c, slow in zip(closed, kinds) if not slow),
            "slow_closed_by_server": sum(c for c, slow in zip(closed, kinds) if slow)}


REFUSALS = ("413 over the limit", "404 unknown model", "400 prompt too long (ctx)", "400 invalid JSON",
            "400 chat of many messages (ctx)")


def refused_body(case: str, max_body_bytes: int, model: str) -> bytes:
    """A body of about ``max_body_bytes`` the deployment refuses as ``case`` says (one of
    ``REFUSALS``): one byte over the limit (the router's 413 before parsing); just under it and
    naming an unknown model (the router parses it, then 404); just under it with a prompt far over
    the context (parsed by the router, forwarded, 400 from the ctx); not JSON (the router's 400);
    a chat of ~50-byte messages just under it (the router validates every message, the ctx renders
    the chat, then 400)."""
    room = max_body_bytes - 256
    if case == REFUSALS[0]:
        return json.dumps({"model": model, "prompt": "x" * max_body_bytes}).encode()[:max_body_bytes + 1]
    if case == REFUSALS[1]:
        return json.dumps({"model": "no-such-model", "prompt": "x" * room}).encode()
    if case == REFUSALS[2]:
        return json.dumps({"model": model, "prompt": "helix prefill " * (room // 14), "max_tokens": 4}).encode()
    if case == REFUSALS[3]:
        return b'{"model": "' + model.encode() + b'", "prompt": "' + b"x" * room  # never closed
    if case == REFUSALS[4]:
        message = {"role": "user", "content": "helix prefill decode cache"}
        num_messages = room // (len(json.dumps(message)) + 2)
        return json.dumps({"model": model, "messages": [message] * num_messages, "max_tokens": 4}).encode()
    raise ValueError(f"unknown refusal case {case!r}; one of {REFUSALS}")


def refused_round(url: str, model: str, num_each: int, max_body_bytes: int,
                  rss: Callable[[], dict[str, tuple[int, int | None]]]) -> list[dict]:
    """``num_each`` bodies of every case in ``REFUSALS`` in turn, one at a time; for each case the
    statuses answered and every process's RSS (``rss()``: ``{name: (pid, bytes)}``) before and
    after it."""
    import httpx

    rows = []
    with httpx.Client(timeout=120) as client:
        for case in REFUSALS:
            body = refused_body(case, max_body_bytes, model)
            statuses: Counter[str] = Counter()
            before = rss()
            for _ in range(num_each):
                try:
                    status = str(client.post(f"{url}/v1/completions" if "chat" not in case else
                                             f"{url}/v1/chat/completions", content=body,
                                             headers={"Content-Type": "application/json"}).status_code)
                except httpx.HTTPError as exc:
                    status = f"transport {type(exc).__name__}"
                statuses[status] += 1
            del body
            rows.append({"case": case, "bodies": num_each, "statuses": dict(statuses), "rss_before": before,
                         "rss_after": rss()})
    return rows


def rss_rows(start: dict, end: dict) -> list[dict]:
    rows = []
    for name in sorted(set(start) | set(end)):
        (pid0, rss0), (pid1, rss1) = start.get(name, (None, None)), end.get(name, (None, None))
        rows.append({"process": name, "pid_start": pid0, "pid_end": pid1, "restarted": pid0 != pid1,
                     "rss_start_mb": rss0 / 2**20 if rss0 else None, "rss_end_mb": rss1 / 2**20 if rss1 else None,
                     "growth_mb": (rss1 - rss0) / 2**20 if rss0 and rss1 and pid0 == pid1 else None})
    return rows


def round_growth(cases: list[dict]) -> list[dict]:
    """Each process's RSS over each whole round of refused bodies: from the first case's start to
    the last case's end (what the allocator gave back between cases counts)."""
    rows = []
    for number in sorted({c["round"] for c in cases}):
        in_round = [c for c in cases if c["round"] == number]
        start = {r["process"]: (r["pid_start"], r["rss_start_mb"]) for r in in_round[0]["rss"]}
        end = {r["process"]: (r["pid_end"], r["rss_end_mb"]) for r in in_round[-1]["rss"]}
        mb = {name: (pid, rss * 2**20 if rss else None) for name, (pid, rss) in start.items()}
        rows.append({"round": number, "rss": rss_rows(mb, {name: (pid, rss * 2**20 if rss else None)
                                                       for name, (pid, rss) in end.items()})})
    return rows


def growth_cell(rows: list[dict], name: str) -> str:
    """``start -> end (+growth)`` MB of one process."""
    row = next((r for r in rows if r["process"] == name), None)
    if row is None or row["rss_start_mb"] is None or row["rss_end_mb"] is None:
        return "-"
    if row["restarted"]:
        return "restarted"
    return f"{row['rss_start_mb']:.1f} -> {row['rss_end_mb']:.1f} ({row['growth_mb']:+.1f})"


def refused_table(refused: dict) -> str:
    """Each case's and each round's RSS per process, ``start -> end (+growth)`` MB."""
    names = sorted({r["process"] for c in refused["cases"] for r in c["rss"]})
    return markdown_table(
        ["round", "case", "statuses"] + [f"{n} MB" for n in names],
        [[c["round"], c["case"], json.dumps(c["statuses"])] + [growth_cell(c["rss"], n) for n in names]
         for c in refused["cases"]]
        + [[r["round"], "whole round", ""] + [growth_cell(r["rss"], n) for n in names] for r in refused["rounds"]])
