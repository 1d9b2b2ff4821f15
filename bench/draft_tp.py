"""A draft model in a cp 2 gen world: on the CP group's leader alone against its heads split over
the group (``speculative.draft_tensor_parallel_size: 2``), in the same run on the same checkpoint.

A dp 1 x cp 2 world (gloo on CPU, NCCL with two GPUs) decodes a batch greedily with the ``draft``
method. Every step runs all ``k + 1`` draft forwards whatever is accepted; the draft model is
``--draft target``, the target's own weights (every draft accepted; as large as the target, the
case where splitting it pays most), or ``--draft cut``, the preset's two-layer cut (a KDA and an
MLA layer, :func:`~helixserve.models.presets.two_layer_draft`; random weights, drafts rejected),
or ``--draft hidden``, the preset's hidden-state drafter (``method: hidden``, one MLA layer,
random weights: only its own draft forwards, k a step, plus the catch-up rows).
Per mode: the leader's draft time per step (``DraftRunner.propose``: its forwards, and under heads
TP the group's all-reduces and the plan message), the whole step's time, decode tok/s, and
whether the tokens equal the other mode's; ratios against leader-only. The world's two modes run
one after the other, ``--reps`` decodes each after a warm-up; figures are medians.

    python bench/draft_tp.py [--quick] [--out FILE] [--preset kimi-k3-tiny] [--draft target|cut|hidden]
                             [--batch 4] [--reps 3]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import base_parser, machine_info, markdown_table, run_decode, write_json  # noqa: E402

import torch  # noqa: E402

from helixserve.config import CacheConfig, SpeculativeConfig  # noqa: E402
from helixserve.engine.core import EngineCore  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.engine.spmd.driver import WorldDriver  # noqa: E402
from helixserve.engine.world_rank import WorldOptions, build_rank, pick_backend, serve_rank  # noqa: E402
from helixserve.launch.processes import run_local_world  # noqa: E402
from helixserve.models.checkpoint import save_checkpoint  # noqa: E402
from helixserve.models.config import KimiModelConfig  # noqa: E402
from helixserve.models.kimi import KimiForCausalLM  # noqa: E402
from helixserve.models.presets import PRESETS, init_random_weights, make_checkpoint, two_layer_draft  # noqa: E402
from helixserve.parallel import Mapping, init_parallel  # noqa: E402

K = 3


def _world(rank: int, world_size: int, init_method: str, model_dir: str, options: WorldOptions,
           prompts: list[list[int]], max_tokens: int, reps: int) -> dict[str, Any] | int:
    mapping = Mapping(world_size, rank, dp=1, cp=world_size)
    groups = init_parallel(mapping, init_method, backend=pick_backend(world_size), local_rank=rank, timeout_s=120)
    try:
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            return serve_rank(part)
        assert isinstance(part, EngineCore) and part.draft_runner is not None
        draft_seconds: list[float] = []
        propose = part.draft_runner.propose

        def timed_propose(out):  # noqa: ANN001, ANN202
            if part.runner.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            record = propose(out)  # its drafts are read on the host: the forwards have run
            draft_seconds.append(time.perf_counter() - start)
            return record
        part.draft_runner.propose = timed_propose  # type: ignore[method-assign]
        driver = WorldDriver(part)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        runs = []
        try:
            for rep in range(reps + 1):  # the first is the warm-up
                draft_seconds.clear()
                ids = [f"r{rep}-{i}" for i in range(len(prompts))]
                run = run_decode(driver, ids, prompts, params)
                decode_steps = len(run.step_seconds) - 1
                runs.append({"tokens": run.tokens, "draft_s": statistics.median(draft_seconds[-decode_steps:]),
                             "step_s": statistics.median(run.step_seconds[1:]),
                             "tok_s": sum(run.step_tokens[1:]) / (run.stamps[-1] - run.stamps[0])})
        finally:
            driver.shutdown()
        timed = runs[1:]
        return {"tokens": timed[0]["tokens"], **{key: statistics.median(r[key] for r in timed)
                                                 for key in ("draft_s", "step_s", "tok_s")}}
    finally:
        groups.destroy()


def two_layer_checkpoint(preset: str, out: Path) -> Path:
    """The preset's two-layer cut with random weights (seed 1)."""
    cfg = KimiModelConfig.model_validate(two_layer_draft(PRESETS[preset]))
    model = KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, 1)
    return save_checkpoint(model, cfg, out, torch.float32)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-k3-tiny")
    parser.add_argument("--draft", choices=["target", "cut", "hidden"], default="target")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    reps, max_tokens = (1, 13) if args.quick else (args.reps, 33)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (24,), generator=gen).tolist() for _ in range(args.batch)]
    cache = CacheConfig(tokens_per_block=16, memory_budget_mib=64, max_num_seqs=max(8, args.batch))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0))
        if args.draft == "hidden":
            draft = str(make_checkpoint(f"{args.preset}-hidden", Path(tmp) / "hidden", seed=3))
        else:
            draft = ckpt if args.draft == "target" else str(two_layer_checkpoint(args.preset, Path(tmp) / "cut"))
        results = {}
        for name, tp in (("leader only", 1), ("heads TP", 2)):
            spec = SpeculativeConfig(method="hidden" if args.draft == "hidden" else "draft", draft_model=draft,
                                     num_draft_tokens=K,
                                     draft_tensor_parallel_size=tp)
            options = WorldOptions(cache=cache, timeout_s=120, speculative=spec, use_cuda_graphs=False)
            results[name] = run_local_world(_world, 2, ckpt, options, prompts, max_tokens, reps, timeout_s=900)[0]
    base = results["leader only"]
    rows = [[name, r["draft_s"] * 1e3, r["draft_s"] / base["draft_s"], r["step_s"] * 1e3, r["step_s"] / base["step_s"],
             r["tok_s"], r["tokens"] == base["tokens"]] for name, r in results.items()]
    drafts = {"target": "the target's weights", "cut": "the two-layer cut", "hidden": "the preset's hidden drafter"}
    print(f"{args.preset}, dp 1 x cp 2, batch {args.batch}, k {K}, draft: {drafts[args.draft]}")
    print(markdown_table(["draft", "draft ms/step", "vs leader only", "step ms", "vs leader only", "decode tok/s",
                          "tokens equal"], rows))
    write_json(args.out, {"machine": machine_info(), "preset": args.preset, "draft": args.draft, "batch": args.batch,
                          "k": K,
                          "results": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}})


if __name__ == "__main__":
    main()
