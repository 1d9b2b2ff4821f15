"""Hostile phases of ``bench/soak.py``: slow and idle connections held while the clients run
(slowloris), and many large bodies the router refuses, with each process's RSS around them."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from urllib.parse import urlparse


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


def refused_bodies(url: str, num_bodies: int, max_body_bytes: int) -> dict:
    """``num_bodies`` large bodies the router refuses, in turn: one byte over ``max_body_bytes``
    (413) and one just under it naming an unknown model (404, after the router parsed it)."""
    import httpx

    statuses: Counter[str] = Counter()
    prompt_bytes = max_body_bytes - 64
    with httpx.Client(timeout=60) as client:
        for i in range(num_bodies):
            size = max_body_bytes + 1 if i % 2 == 0 else prompt_bytes
            body = json.dumps({"model": "no-such-model", "prompt": "x" * (size - 40)}).encode()
            body = body[:max_body_bytes + 1] if i % 2 == 0 else body
            try:
                status = str(client.post(f"{url}/v1/completions", content=body,
                                         headers={"Content-Type": "application/json"}).status_code)
            except httpx.HTTPError as exc:
                status = f"transport {type(exc).__name__}"
            statuses[status] += 1
    return dict(statuses)
