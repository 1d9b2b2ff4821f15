"""Decode tok/s and the host share of a decode step through an engine-like object on a GPU.

Used by ``bench/kernels.py``'s engine rows: the single-process engine (``LLM.engine``) and a gen
world of one (``LocalWorld.driver``) are driven the same way (``_common.run_decode``). The host
share is the part of the decode steps' wall time outside their GPU-busy spans, each from a CUDA-graph
launch to the sampler's last kernel; it needs the CUDA-graph ``ModelRunner`` behind the engine
(:func:`find_runner`) and is ``None`` without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from _common import EngineLike, run_decode


def find_runner(engine: Any) -> Any | None:
    """The CUDA-graph ``ModelRunner`` an engine-like object steps, if one is reachable.

    ``EngineCore.runner``; for a world's driver, its group-0 EngineCore's (``driver.core.runner``).
    ``None`` when none has ``decode_graphs`` and ``sampler``.
    """
    for path in (("runner",), ("core", "runner")):
        obj = engine
        for name in path:
            obj = getattr(obj, name, None)
        if obj is not None and getattr(obj, "decode_graphs", None) is not None and hasattr(obj, "sampler"):
            return obj
    return None


class _GpuSpans:
    """Patches a runner's graph launch and sampler launch to record each decode step's GPU span."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.spans, self.active = runner, [], False

    def start(self) -> None:
        graphs, sampler = self.runner.decode_graphs, self.runner.sampler
        launch, sample_launch = graphs.launch, sampler.launch
        spans = self.spans

        def timed_launch(*a):
            spans.append(torch.cuda.Event(enable_timing=True))
            spans[-1].record()
            return launch(*a)

        def timed_sample(*a):
            tokens = sample_launch(*a)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if not spans or isinstance(spans[-1], tuple):
                raise RuntimeError("a decode step ran eagerly (no graph launch before its sampling)")
            spans[-1] = (spans[-1], end)
            return tokens

        graphs.launch, sampler.launch = timed_launch, timed_sample
        self.active = True

    def stop(self) -> None:
        if self.active:
            del self.runner.decode_graphs.launch, self.runner.sampler.launch  # the shadowing instance attributes
            self.active = False

    def gpu_seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3


def decode_rate(engine: EngineLike, prompts: Sequence[list[int]], new_tokens: int, prefix: str,
                runner: Any | None = None) -> tuple[float, float | None]:
    """Decode tok/s of one request per prompt (prefill excluded) and, with a CUDA-graph ``runner``,
    the share of the decode steps' wall time outside their GPU-busy spans (else ``None``).

    Every step launched while timing is also read back in it (``run_decode`` drains a step still in
    flight, counted here); a step enqueued ahead during the prefill is read back while timing but its
    GPU span is not counted (conservative).
    """
    from helixserve.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    spans = _GpuSpans(runner) if runner is not None else None
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    try:
        run = run_decode(engine, ids, prompts, params, on_decode_start=spans.start if spans else None)
    finally:
        if spans is not None:
            spans.stop()
    short = {rid: len(t) for rid, t in zip(ids, run.tokens) if len(t) != new_tokens}
    if short:  # a failed step (an engine reports it on the requests, e.g. an eager decode step above)
        raise RuntimeError(f"requests ended with fewer than {new_tokens} tokens: {short}")
    walls = sum(run.step_seconds[1:]) + sum(run.drain_seconds)
    tok_s = run.decode_tokens / walls
    return tok_s, (1 - spans.gpu_seconds() / walls) if spans is not None and spans.spans else None
