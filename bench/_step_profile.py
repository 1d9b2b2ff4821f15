"""Where a decode step's time goes: a per-phase breakdown of batch-1 decode steps ("phase" rows).

The decode of one request is traced with ``torch.profiler`` (CUDA activity on a GPU: the kernels
of the replayed CUDA graph are recorded one by one; CPU operators on the CPU). Every device
kernel is put in one phase by its name (:data:`PHASES`, first match wins; ``other`` else), and
per phase the rows give the time per step, the kernels launched per step and the share of the
step's device time; a last row gives the device-busy time per step against the step's wall time
(what the host adds on top).
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from _common import run_decode

from helixserve.engine.request import SamplingParams

TOP_KERNELS = 25  # the device-busy row's JSON lists this many kernels by time (name, phase, us and launches per step)

# (phase, pattern over the lower-cased kernel name); first match wins
PHASES: tuple[tuple[str, str], ...] = (
    ("moe experts", r"grouped|moe|expert|mxfp4|act_and_mul|silu|gate_up|down_pairs|sum_pairs"),
    ("kda", r"kda|delta|recurrent|short_conv|conv1d|chunk_"),
    ("mla attention", r"mla|flash|attn|softmax|_lse"),  # not "lse": cuBLAS names hold "false"
    ("gemm", r"gemm|gemv|matmul|_mm|cublas|cutlass|sm90|nvjet|splitk"),
    ("norm", r"norm|rsqrt"),
    ("sampling", r"argmax|topk|sort|multinomial|sample|gumbel"),
    ("copies", r"copy|cat|index|gather|scatter|fill|memcpy|memset"),
)


def phase_of(name: str) -> str:
    lower = name.lower()
    for phase, pattern in PHASES:
        if re.search(pattern, lower):
            return phase
    return "other"


def _device_events(prof: Any, on_gpu: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every device kernel (GPU) or top-level operator (CPU) traced."""
    out = []
    for event in prof.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            out.append((event.name, event.device_time))
        elif not on_gpu and event.device_type == torch.autograd.DeviceType.CPU and event.cpu_parent is None:
            out.append((event.name, event.cpu_time_total))
    return out


def step_profile_rows(llm: Any, model_name: str, new_tokens: int, on_gpu: bool, row) -> None:  # noqa: ANN001
    """Trace the decode steps of one 128-token request generating ``new_tokens`` (after an untimed
    warm-up run of the same request)."""
    engine = llm.engine
    prompt = torch.randint(0, min(llm.model_config.vocab_size, 256), (128,),
                           generator=torch.Generator().manual_seed(41)).tolist()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    run_decode(engine, ["phase-warm"], [prompt], params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = profile(activities=activities)
    began = [0.0]

    def start() -> None:  # the prefill is not traced: from the first decode step on
        began[0] = time.perf_counter()
        prof.start()

    try:
        run = run_decode(engine, ["phase-0"], [prompt], params, on_decode_start=start)
    finally:
        if began[0]:
            prof.stop()
    wall = time.perf_counter() - began[0]
    steps = max(1, run.decode_tokens)
    step_wall_us = 1e6 * (sum(run.step_seconds[1:]) + sum(run.drain_seconds)) / max(1, steps - 1)
    by_phase: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for name, us in _device_events(prof, on_gpu):
        by_phase.setdefault(phase_of(name), []).append(us)
        by_name.setdefault(name, []).append(us)
    top = [{"kernel": name[:120], "phase": phase_of(name), "us_per_step": sum(t) / steps,
            "launches_per_step": len(t) / steps}
           for name, t in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]]
    total = sum(sum(v) for v in by_phase.values()) or 1.0
    for phase, times in sorted(by_phase.items(), key=lambda kv: -sum(kv[1])):
        row("phase", f"{model_name} bs1 {phase}", sum(times) / steps, None, "us/step", "-",
            f"{sum(times) / total:.1%}", f"{len(times) / steps:.1f} launches/step",
            model=model_name, phase=phase, us_per_step=sum(times) / steps, launches_per_step=len(times) / steps)
    row("phase", f"{model_name} bs1 device busy", total / steps, step_wall_us, "us/step", "step wall",
        f"{total / steps / step_wall_us:.1%}", f"{steps} steps traced in {wall:.2f} s",
        model=model_name, phase="device busy", us_per_step=total / steps, step_wall_us=step_wall_us,
        top_kernels=top)
    if on_gpu:
        launches = round(sum(len(t) for t in by_phase.values()) / steps)
        floor = launch_floor_us(launches)
        row("phase", f"{model_name} bs1 launch floor", floor, step_wall_us, "us/step", "step wall",
            f"{floor / step_wall_us:.1%}", f"a CUDA graph of {launches} one-element kernels (the step's launches)",
            model=model_name, phase="launch floor", us_per_step=floor, launches_per_step=launches,
            step_wall_us=step_wall_us)


def launch_floor_us(launches: int, replays: int = 50) -> float:
    """Microseconds one replay of a CUDA graph of ``launches`` one-element kernels takes: what a
    step of that many kernels costs however little each does (best of three timings)."""
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # the kernel loads before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            x.add_(1)
    graph.replay()
    best = float("inf")
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3 / replays)
    return best
