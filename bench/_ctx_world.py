"""The ctx world rows of ``bench/engine.py``: prefill through ctx worlds on the CPU (gloo).

- "ctx world of one prefill": a world of one (dp 1 x cp 1, ``start_local_world``: this process its
  only rank) against the single-process engine, the same batch of prompts prefilled (one sampled
  token each), alternating in one measurement; ratio = world / single (target >= 0.95).
- "tp 2 prefill": the same batch through a world of two ranks (this process rank 0, one spawned
  rank of one thread) in each layout a ctx world could take: the helix layout dp 1 x cp 2 (KDA
  heads and MLA value heads tensor-parallel, MLA latent pages dealt round-robin, token-sliced MoE
  with experts over both ranks: the layout the gen world consumes) and attention DP + EP, dp 2 x
  cp 1 (each rank the whole attention of its own requests, experts over both ranks).

One world at a time (one process joins one world): each layout takes turns with the single engine
in its own measurement; ``vs single`` = its tok/s / the single engine's measured beside it (so
load from other processes on a shared machine falls on both alike), and whether its greedy first
tokens equal the single engine's.

tok/s = prompt tokens of the batch / wall seconds from the first add to the last first token, of
the fastest repetition (``tok_s``: on a machine shared with other work the fastest is the one least
disturbed; every repetition's seconds and the median's tok/s are kept beside it). Wall time on an
oversubscribed machine says little, so each repetition's CPU seconds are counted too, summed over
every rank's process (``/proc/PID/stat``: user + system): ``cpu_tok_s`` = prompt tokens / the
median CPU seconds, the work a layout spends on the batch whatever else runs on the machine.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from _common import markdown_table, measure, median, run_decode

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.world_rank import WorldOptions
from helixserve.serving.local_world import LocalWorld, start_local_world

TARGET_CTX_WORLD_RATIO = 0.95
LAYOUTS = {"world of one": (1, 1), "tp 2 helix (dp 1 x cp 2)": (1, 2), "tp 2 attention DP (dp 2 x cp 1)": (2, 1)}
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class CtxWorldRow:
    """One layout's prefill of the batch, against the single engine's in the same run."""

    model: str
    layout: str
    dp: int
    cp: int
    batch: int
    prompt_len: int
    tok_s: float  # fastest repetition
    single_tok_s: float
    median_tok_s: float
    median_single_tok_s: float
    seconds: list[float]
    single_seconds: list[float]
    first_tokens_equal: str
    cpu_seconds: list[float]  # every rank's process, summed
    single_cpu_seconds: list[float]

    @property
    def cpu_tok_s(self) -> float:
        return self.batch * self.prompt_len / median(self.cpu_seconds)

    @property
    def single_cpu_tok_s(self) -> float:
        return self.batch * self.prompt_len / median(self.single_cpu_seconds)

    @property
    def ratio(self) -> float:
        return self.tok_s / self.single_tok_s


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux ``/proc``)."""
    total = 0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total * _TICK_S


def ctx_world_rows(name: str, path: Path, llm: LLM, prompts: list[list[int]], cache: CacheConfig,
                   scheduler: SchedulerConfig, warmup: int, reps: int) -> list[CtxWorldRow]:
    """Every layout of :data:`LAYOUTS` against ``llm`` on ``prompts`` (see the module docstring)."""
    options = WorldOptions(cache=cache, scheduler=scheduler, dtype="float32", timeout_s=600)
    ids = itertools.count()
    num_tokens = sum(len(p) for p in prompts)
    rows = []
    for layout, (dp, cp) in LAYOUTS.items():
        tokens: dict[str, list[list[int]]] = {}
        cpu: dict[str, list[float]] = {"single": [], "world": []}
        world: LocalWorld = start_local_world(path, dp=dp, cp=cp, options=options)
        pids = {"single": [os.getpid()], "world": [os.getpid(), *(p.pid for p in world.processes)]}

        def prefill(side: str, engine) -> None:  # noqa: ANN001 (an EngineCore or a world's driver)
            before = cpu_seconds(pids[side])
            tokens[side] = run_decode(engine, [f"{side}-{next(ids)}" for _ in prompts], prompts, GREEDY_ONE).tokens
            cpu[side].append(cpu_seconds(pids[side]) - before)

        try:
            single_s, world_s = measure([lambda: prefill("single", llm.engine),
                                         lambda w=world: prefill("world", w.driver)], warmup, reps)
        finally:
            world.close()
        same = sum(a == b for a, b in zip(tokens["world"], tokens["single"], strict=True))
        rows.append(CtxWorldRow(name, layout, dp, cp, len(prompts), len(prompts[0]), num_tokens / min(world_s),
                                num_tokens / min(single_s), num_tokens / median(world_s),
                                num_tokens / median(single_s), world_s, single_s, f"{same}/{len(prompts)}",
                                cpu["world"][warmup:], cpu["single"][warmup:]))
    return rows


def ctx_world_table(rows: list[CtxWorldRow]) -> str:
    """The rows as a Markdown table (fastest repetition, median in parentheses)."""
    def vs_single(r: CtxWorldRow) -> str:
        target = (f" (≥ {TARGET_CTX_WORLD_RATIO:g}: {'yes' if r.ratio >= TARGET_CTX_WORLD_RATIO else 'no'})"
                  if (r.dp, r.cp) == (1, 1) else "")
        return f"{r.ratio:.2f}×{target}"

    return markdown_table(
        ["model", "layout", "batch", "tok/s", "single tok/s", "vs single", "tok per CPU s (single)", "first tokens equal"],
        [[r.model, r.layout, f"{r.batch}×{r.prompt_len}", f"{r.tok_s:,.0f} ({r.median_tok_s:,.0f})",
          f"{r.single_tok_s:,.0f} ({r.median_single_tok_s:,.0f})", vs_single(r),
          f"{r.cpu_tok_s:,.0f} ({r.single_cpu_tok_s:,.0f})", r.first_tokens_equal] for r in rows])


def cpu_figures(row: CtxWorldRow) -> dict[str, float]:
    """The derived CPU figures a row's JSON carries beside its fields."""
    return {"cpu_tok_s": row.cpu_tok_s, "single_cpu_tok_s": row.single_cpu_tok_s}
