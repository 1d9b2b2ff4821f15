"""Shared bench helpers: the common flags, timing (warm-up, then median), Markdown table, JSON out."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
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
