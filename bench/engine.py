"""Single-process engine throughput on CPU against transformers on the same checkpoint.

Prefill: tok/s of one 512-token prompt (``LLM.generate``, one sampled token; transformers:
``forward(logits_to_keep=1)``). Decode: tok/s of greedy decoding at batch 1 and 8 (``EngineCore.step``
loop; transformers: ``generate``), timed from the first sampled token to the last, so the prompt's
prefill is not counted. Both run in this process with the same ``torch.set_num_threads``; each
figure is the median of a few repetitions after a warm-up.

World rows ("world decode bs1/bs8"): the same decode through a gen world of one (dp 1 x cp 1,
``start_local_world``: this process is its only rank) on the same checkpoint, cache and scheduler
config, prompts and threads, timed the same way (``_common.run_decode``) alternating with the
single-process engine (``LLM``); ``ratio`` = world / single (target >= 0.95), and whether their
greedy tokens are equal. ``--world-models`` picks the models that get them.

ctx world rows ("ctx world"): prefill of a batch through a ctx world of one and through worlds of
two ranks in the helix layout (dp 1 x cp 2) and in attention DP + EP (dp 2 x cp 1), against the
single engine in the same run (``bench/_ctx_world.py`` says how). ``--ctx-world-models`` picks the
models; ``--only ctx-world`` runs these rows alone.

Models: ``kimi-linear-tiny`` (the preset), ``kimi-linear-bench`` (built here: hidden 256, 8 layers =
6 KDA + 2 MLA, 16 experts top-2), both as random-weight transformers models written with
``save_pretrained`` and loaded by helixserve; ``kimi-k3-tiny`` (our ``make_checkpoint``) has no
transformers counterpart, so its rows carry our figures only.

    python bench/engine.py [--quick] [--out FILE] [--threads N] [--models a,b] [--world-models a,b]
                           [--ctx-world-models a,b] [--only engine,ctx-world]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# transformers (and our kernels) switch to Triton kernels whenever triton imports; those cannot run
# on a CPU, so block it before anything imports it: both sides take their PyTorch paths, as on a
# machine without triton.
if not torch.cuda.is_available():
    sys.modules.setdefault("triton", None)

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, machine_info, markdown_table, measure, median, run_decode, write_json  # noqa: E402
from _ctx_world import TARGET_CTX_WORLD_RATIO, CtxWorldRow, cpu_figures, ctx_world_rows, ctx_world_table  # noqa: E402

from helixserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.engine.world_rank import WorldOptions  # noqa: E402
from helixserve.serving.local_world import LocalWorld, start_local_world  # noqa: E402
from helixserve.models.config import KimiModelConfig  # noqa: E402
from helixserve.models.presets import PRESETS, make_checkpoint  # noqa: E402
from helixserve.testing.hf_reference import build_hf_reference  # noqa: E402

TARGET_RATIO = 2.0
TARGET_WORLD_RATIO = 0.95
PREFILL_LEN = 512
DECODE_PROMPT_LEN = 32

# BENCHMARKS.md's orientation shape: hidden 256, 8 layers (6 KDA + 2 MLA), 16 experts top-2
KIMI_LINEAR_BENCH: dict[str, Any] = {
    **PRESETS["kimi-linear-tiny"],
    "hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "linear_attn_config": {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
    "num_experts": 16, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 128,
}


@dataclass(slots=True)
class Row:
    model: str
    metric: str
    ours_tok_s: float
    hf_tok_s: float | None
    ours_seconds: list[float]
    hf_seconds: list[float] | None
    tokens_match: str | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.hf_tok_s is None else self.ours_tok_s / self.hf_tok_s


@dataclass(slots=True)
class WorldRow:
    """A gen world of one against the single-process engine, measured alternately in this run."""

    model: str
    metric: str
    world_tok_s: float
    single_tok_s: float
    world_seconds: list[float]
    single_seconds: list[float]
    tokens_match: str

    @property
    def ratio(self) -> float:
        return self.world_tok_s / self.single_tok_s


def build_hf_checkpoint(config: dict[str, Any], out: Path) -> torch.nn.Module:
    """A random fp32 transformers KimiLinear model, saved to ``out`` (which helixserve loads)."""
    cfg = KimiModelConfig.model_validate(config)
    hf = build_hf_reference(cfg, out)
    hf.generation_config.eos_token_id = None  # decode the full length, like ignore_eos
    hf.generation_config.pad_token_id = cfg.pad_token_id
    return hf


def transformers_kda_paths() -> dict[str, str]:
    """Which implementation transformers resolved for each KDA op (its PyTorch path or fla's)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    paths = {}
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn"):
        fn = getattr(modeling, name)
        while fn is not None:
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            if "implementation" in cells:
                impl = cells["implementation"]
                paths[name] = f"{impl.__module__}.{impl.__qualname__}"
                break
            fn = getattr(fn, "__wrapped__", None)
    return paths


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, length), generator=gen).tolist()


class _StepClock:
    """A logits processor that stamps the time after each forward of ``generate``."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


class Bench:
    def __init__(self, name: str, llm: LLM, hf: torch.nn.Module | None, args, world: LocalWorld | None = None) -> None:
        self.name, self.llm, self.hf, self.args, self.world = name, llm, hf, args, world
        self._ids = itertools.count()
        self._seeds = itertools.count(1)
        self.last_tokens: dict[str, list[list[int]]] = {}

    def _measure(self, ours, hf) -> tuple[list[float], list[float] | None]:
        if self.hf is None:
            return measure([ours], self.args.warmup, self.args.reps)[0], None
        ours_s, hf_s = measure([ours, hf], self.args.warmup, self.args.reps)
        return ours_s, hf_s

    def prefill(self) -> Row:
        greedy_one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def ours() -> None:
            self.llm.generate(prompts(1, PREFILL_LEN, next(self._seeds)), greedy_one)

        def hf() -> None:
            ids = torch.tensor(prompts(1, PREFILL_LEN, next(self._seeds)))
            with torch.inference_mode():
                self.hf(input_ids=ids, logits_to_keep=1)

        return self._row("prefill bs1×512", PREFILL_LEN, *self._measure(ours, hf))

    def decode(self, batch: int) -> list[Row | WorldRow]:
        """The engine's decode row against transformers, and against it the world's (if any);
        all sides take turns in one measurement."""
        n = self.args.new_tokens
        batch_prompts = prompts(batch, DECODE_PROMPT_LEN, seed=1000 + batch)
        sides = {"ours": lambda: self._engine_decode("ours", self.llm.engine, batch_prompts, n)}
        if self.hf is not None:
            sides["hf"] = lambda: self._hf_decode(batch_prompts, n)
        if self.world is not None:
            sides["world"] = lambda: self._engine_decode("world", self.world.driver, batch_prompts, n)
        times = dict(zip(sides, measure(list(sides.values()), self.args.warmup, self.args.reps), strict=True))
        tokens = batch * (n - 1)
        rows: list[Row | WorldRow] = [self._row(f"decode bs{batch}", tokens, times["ours"], times.get("hf"),
                                                self._match("ours", "hf") if self.hf is not None else None)]
        if self.world is not None:
            world, single = tokens / median(times["world"]), tokens / median(times["ours"])
            rows.append(WorldRow(self.name, f"world decode bs{batch}", world, single, times["world"], times["ours"],
                                 self._match("world", "ours")))
        return rows

    def _match(self, a: str, b: str) -> str:
        """How many greedy tokens of the last ``a`` and ``b`` runs agree, position by position."""
        ra, rb = self.last_tokens[a], self.last_tokens[b]
        same = sum(x == y for ta, tb in zip(ra, rb, strict=True) for x, y in zip(ta, tb, strict=True))
        return f"{same}/{sum(len(t) for t in ra)}"

    def _engine_decode(self, side: str, engine, batch_prompts: list[list[int]], n: int) -> float:
        """Decode seconds of one batch through an ``EngineCore`` or a world's driver."""
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        ids = [f"bench-{side}-{next(self._ids)}" for _ in batch_prompts]
        run = run_decode(engine, ids, batch_prompts, params)
        assert run.num_prefill_steps == 1 and len(run.stamps) == n, (
            f"expected one prefill step and {n - 1} decode steps, "
            f"got {run.num_prefill_steps} and {len(run.stamps) - 1}")
        assert all(len(t) == n for t in run.tokens), [len(t) for t in run.tokens]
        self.last_tokens[side] = run.tokens
        return run.decode_seconds

    def _hf_decode(self, batch_prompts: list[list[int]], n: int) -> float:
        from transformers import LogitsProcessorList

        ids = torch.tensor(batch_prompts)
        clock = _StepClock()
        out = self.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
        assert len(clock.stamps) == n
        self.last_tokens["hf"] = out[:, ids.shape[1]:].tolist()
        return clock.stamps[-1] - clock.stamps[0]

    def _row(self, metric: str, tokens: int, ours: list[float], hf: list[float] | None, match: str | None = None) -> Row:
        return Row(self.name, metric, tokens / median(ours), None if hf is None else tokens / median(hf), ours, hf, match)


# budget far above what the bench needs, so no preemption; 512-token prompts in one chunk
CACHE = CacheConfig(memory_budget_mib=512, max_num_seqs=16)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=2048)


def load_llm(path: Path) -> LLM:
    return LLM(path, dtype="float32", cache=CACHE, scheduler=SCHEDULER)


def load_world(path: Path) -> LocalWorld:
    """A gen world of one (this process is its rank 0) with the single engine's settings."""
    return start_local_world(path, dp=1, cp=1, options=WorldOptions(cache=CACHE, scheduler=SCHEDULER, dtype="float32"))


def run_model(name: str, workdir: Path, args) -> list[Row | WorldRow | CtxWorldRow]:
    path = workdir / name
    if name == "kimi-k3-tiny":
        make_checkpoint(name, path)
        hf = None
    else:
        hf = build_hf_checkpoint(KIMI_LINEAR_BENCH if name == "kimi-linear-bench" else PRESETS[name], path)
    llm = load_llm(path)
    rows: list[Row | WorldRow | CtxWorldRow] = []
    if "engine" in args.only:
        world = load_world(path) if name in args.world_models.split(",") else None
        try:
            bench = Bench(name, llm, hf, args, world)
            rows += [bench.prefill(), *bench.decode(1), *bench.decode(8)]
        finally:
            if world is not None:
                world.close()
    if "ctx-world" in args.only and name in args.ctx_world_models.split(","):
        batch, length = (2, 256) if args.quick else (4, PREFILL_LEN)
        rows += ctx_world_rows(name, path, llm, prompts(batch, length, seed=77), CACHE, SCHEDULER,
                               args.warmup, args.ctx_world_reps or args.reps)
    for row in rows:
        if isinstance(row, CtxWorldRow):
            print(f"  ctx {row.layout:<32} {row.tok_s:9.1f} tok/s   single {row.single_tok_s:9.1f} tok/s"
                  f"   {row.ratio:.2f}x", flush=True)
        elif isinstance(row, WorldRow):
            print(f"  {row.metric:<22} world {row.world_tok_s:9.1f} tok/s   single {row.single_tok_s:9.1f} tok/s"
                  f"   {row.ratio:.2f}x", flush=True)
        else:
            print(f"  {row.metric:<22} ours {row.ours_tok_s:9.1f} tok/s   "
                  f"transformers {row.hf_tok_s or float('nan'):9.1f} tok/s", flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument("--models", default="kimi-linear-tiny,kimi-linear-bench,kimi-k3-tiny")
    parser.add_argument("--world-models", default="kimi-linear-bench,kimi-k3-tiny",
                        help="models of --models that also get world rows (a dp 1 x cp 1 gen world)")
    parser.add_argument("--ctx-world-models", default="kimi-linear-bench,kimi-k3-tiny",
                        help="models of --models that get ctx world prefill rows (worlds of one and of two ranks)")
    parser.add_argument("--only", default="engine,ctx-world", help="sections: engine, ctx-world")
    parser.add_argument("--ctx-world-reps", type=int, default=None, help="repetitions of the ctx world rows")
    return parser


def _quiet_transformers() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main() -> None:
    args = _parser().parse_args()
    args.warmup, args.reps, args.new_tokens = (1, 3, 16) if args.quick else (1, 5, 64)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    _quiet_transformers()
    started = time.perf_counter()
    args.only = set(args.only.split(","))
    rows: list[Row | WorldRow | CtxWorldRow] = []
    with tempfile.TemporaryDirectory(prefix="helix-bench-") as tmp:
        for name in args.models.split(","):
            print(f"{name}:", flush=True)
            rows += run_model(name, Path(tmp), args)
    elapsed = time.perf_counter() - started

    info = machine_info()
    headers = ["model", "metric", "helixserve tok/s", "transformers tok/s", "ratio", f"≥ {TARGET_RATIO:g}×", "greedy tokens equal"]
    table = markdown_table(headers, [
        [r.model, r.metric, r.ours_tok_s, r.hf_tok_s,
         None if r.ratio is None else f"{r.ratio:.2f}×",
         "n/a (no transformers K3)" if r.ratio is None else ("yes" if r.ratio >= TARGET_RATIO else "no"),
         r.tokens_match]
        for r in rows if isinstance(r, Row)
    ])
    world_headers = ["model", "metric", "world tok/s", "single tok/s", "ratio", f"≥ {TARGET_WORLD_RATIO:g}×",
                     "greedy tokens equal"]
    world_table = markdown_table(world_headers, [
        [r.model, r.metric, r.world_tok_s, r.single_tok_s, f"{r.ratio:.2f}×",
         "yes" if r.ratio >= TARGET_WORLD_RATIO else "no", r.tokens_match]
        for r in rows if isinstance(r, WorldRow)
    ])
    print()
    print(f"CPU, {info['cpu_count']} cores, torch {info['torch']}, {info['torch_threads']} threads; "
          f"`{info['command']}`; medians of {args.reps} after {args.warmup} warm-up; "
          f"decode: prompt {DECODE_PROMPT_LEN}, {args.new_tokens} new tokens, prefill not counted")
    print(table)
    if world_table.count("\n") > 1:
        print("\ngen world of one (dp 1 × cp 1, this process) vs the single-process engine, same run:")
        print(world_table)
    ctx_rows = [r for r in rows if isinstance(r, CtxWorldRow)]
    if ctx_rows:
        print("\nctx world prefill (batch x prompt tokens, one sampled token each) vs the single engine, same run, "
              "fastest repetition (median in parentheses):")
        print(ctx_world_table(ctx_rows))
    print(f"\ntotal {elapsed:.1f} s")
    write_json(args.out, {
        "bench": "engine",
        "machine": info,
        "settings": {"quick": args.quick, "warmup": args.warmup, "reps": args.reps, "prefill_len": PREFILL_LEN,
                     "decode_prompt_len": DECODE_PROMPT_LEN, "new_tokens": args.new_tokens,
                     "target_ratio": TARGET_RATIO, "target_world_ratio": TARGET_WORLD_RATIO,
                     "world_models": args.world_models.split(","), "kimi_linear_bench_config": KIMI_LINEAR_BENCH,
                     "ctx_world_models": args.ctx_world_models.split(","), "only": sorted(args.only),
                     "target_ctx_world_ratio": TARGET_CTX_WORLD_RATIO, "ctx_world_reps": args.ctx_world_reps or args.reps},
        "transformers_kda_paths": transformers_kda_paths(),
        "results": [{**asdict(r), "ratio": r.ratio, **(cpu_figures(r) if isinstance(r, CtxWorldRow) else {})}
                    for r in rows],
        "total_seconds": elapsed,
    })


if __name__ == "__main__":
    main()
