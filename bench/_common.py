"""Shared bench helpers: the common flags, timing (warm-up, then median), decoding through an
engine-like object (``EngineCore``, a gen world's driver), Markdown table, JSON out."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


def base_parser(description: str) -> argparse.ArgumentParser:
    """``--quick`` and ``--out FILE``, which every bench takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small run, under a minute on CPU")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    return parser


def measure(fns: Sequence[Callable[[], float | None]], warmup: int, reps: int) -> list[list[float]]:
    """Seconds of ``reps`` calls of each of ``fns`` after ``warmup`` unrecorded calls each.

    The functions take turns (a, b, a, b, ...) so that load from other processes on a shared
    machine falls on all of them alike. A function may return its own measured seconds (e.g. only
    the decode part of a generate call); when it returns ``None`` its wall time is recorded.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            inner = fn()
            out.append(time.perf_counter() - start if inner is None else inner)
    return times


class EngineLike(Protocol):
    """What :func:`run_decode` drives: ``EngineCore`` and a gen world's ``WorldDriver`` both are."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> Any: ...

    def step(self) -> Sequence[Any]: ...  # RequestUpdate: .request_id, .token_id, .is_finished

    def has_unfinished_requests(self) -> bool: ...


@dataclass(slots=True)
class DecodeRun:
    """One batch decoded by :func:`run_decode`.

    ``stamps`` / ``step_seconds`` / ``step_tokens``: for every step from the one that gave the
    last of the batch its first token (the prefill's end) to the one that sampled the last token,
    the ``perf_counter`` after it, its wall time and how many of the batch's tokens it sampled.
    """

    tokens: list[list[int]]  # per request, in prompt order
    stamps: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    num_prefill_steps: int = 0  # steps until every request had its first token
    drain_seconds: list[float] = field(default_factory=list)  # steps after the last token (work in flight)

    @property
    def decode_seconds(self) -> float:
        """From the prefill's last sampled token to the last sampled token."""
        return self.stamps[-1] - self.stamps[0]

    @property
    def decode_tokens(self) -> int:
        """Tokens sampled after the prefill's end (the first step's are the prefill's)."""
        return sum(self.step_tokens[1:])


def run_decode(engine: EngineLike, request_ids: Sequence[str], prompts: Sequence[list[int]], params: Any,
               on_decode_start: Callable[[], None] | None = None, max_idle_steps: int = 64) -> DecodeRun:
    """Add one request per prompt, step ``engine`` until all of them finished; see :class:`DecodeRun`.

    Stops when these requests finished, not when the engine is idle (a world's driver also steps
    for heartbeats), then steps at most 4 more times while the engine says it has work (an
    overlapped step still in flight). ``on_decode_start`` runs once every request has its first
    token, before the first decode step. Raises ``RuntimeError`` after ``max_idle_steps``
    consecutive steps that sampled none of these tokens.
    """
    index = {rid: i for i, rid in enumerate(request_ids)}
    run = DecodeRun([[] for _ in request_ids])
    for rid, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(rid, list(prompt), params)
    unfinished, idle, decoding = set(request_ids), 0, False
    while unfinished:
        start = time.perf_counter()
        updates = [u for u in engine.step() if u.request_id in index]
        end = time.perf_counter()
        for u in updates:
            if u.token_id >= 0:
                run.tokens[index[u.request_id]].append(u.token_id)
            if u.is_finished:
                unfinished.discard(u.request_id)
        idle = 0 if updates else idle + 1
        if idle > max_idle_steps:
            raise RuntimeError(f"{max_idle_steps} steps sampled no token of {sorted(unfinished)[:4]}")
        if not decoding:
            run.num_prefill_steps += 1
            if all(run.tokens):  # this step gave the batch's last first token: the prefill's end
                decoding = True
                run.stamps, run.step_seconds, run.step_tokens = [end], [end - start], [len(updates)]
                if on_decode_start is not None and unfinished:
                    on_decode_start()
            continue
        run.stamps.append(end)
        run.step_seconds.append(end - start)
        run.step_tokens.append(sum(u.token_id >= 0 for u in updates))
    for _ in range(4):
        if not engine.has_unfinished_requests():
            break
        start = time.perf_counter()
        engine.step()
        run.drain_seconds.append(time.perf_counter() - start)
    return run


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


_SLEEP_CYCLES = 2_000_000  # about 1 ms at the H200's clock


def gpu_timer(fns: list[Callable[[], Any]], warmup: int, reps: int) -> list[float]:
    """Median seconds of each fn (:func:`measure`'s turns); CUDA events on a GPU, perf_counter
    otherwise."""
    import torch

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            if not torch.cuda.is_available():
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # keep the GPU busy while the host enqueues fn, so the events time the GPU work,
            # not the host's launch latency (as in a CUDA graph)
            torch.cuda._sleep(_SLEEP_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return run

    return [statistics.median(t) for t in measure([timed(fn) for fn in fns], warmup, reps)]


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


async def sse_events(response, url: str):  # noqa: ANN001, ANN201 (an httpx streamed response; an async iterator)
    """The JSON events of an OpenAI SSE stream (``[DONE]`` and non-data lines skipped);
    ``RuntimeError`` on a non-200 answer."""
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])
