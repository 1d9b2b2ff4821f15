"""Speculative decoding (n-gram prompt lookup, draft model) against plain decoding, single process.

Decode tok/s of greedy decoding at batch 1 and 8 with and without a drafter, in the same run on
the same checkpoint (``_common.run_decode``: timed from the prefill's last token to the last
token), on two prompt sets: ``repetitive`` (prompts made of a repeated short pattern) and
``random`` (uniform random ids: the cost when nothing is accepted). The drafters: the n-gram
lookup; the ``draft`` method with the target's own weights (every draft accepted: the upper
bound of acceptance; each step costs k + 1 forwards of a draft model as large as the target
here) and with another seed's weights (nothing accepted: the lower bound); the ``hidden`` method
(a one-layer hidden-state drafter, ``kimi-linear-tiny-hidden``, random weights). Each row says whether
the speculative tokens equal plain decoding's, the acceptance rate and acceptance per draft
position. The random-weight presets do not continue their prompts' patterns, so n-gram
acceptance stays low on both sets here; its rows measure the verify step's cost (k + 1 rows per
sequence, eager, no overlap) against a plain decode step.

The cost of a step that drafts nothing, at batch 64: speculation on (prompt lookup of 5-grams)
over prompts of distinct ids, where lookup finds nothing to draft, so every step is a plain
decode step plus the drafter's lookups. Plain and speculative runs alternate ``--repeats``
times; the ratio is the median over rounds of the round's speculative / plain tok/s, in wall
time and in this process's CPU time (``time.process_time`` over the decode steps: less sensitive
to other processes on a shared machine); tok/s are each side's best. A second plain engine runs
in every round too: its median ratio to the first is the noise floor.

``--checkpoint DIR`` runs a given checkpoint instead of a random-weight ``kimi-linear-tiny`` (e.g.
one ``helixserve make-checkpoint --train-on`` trained; its ``DIR/draft`` and ``DIR/hidden``, when
there, are the second draft model and the hidden drafter in place of random weights;
``--methods`` picks the drafters to run); ``--prompts-from DIR`` adds a third prompt
set, ``held-out``: windows of the held-out files under ``DIR`` (the split the training used, read
from the checkpoint's ``training_log.json`` when it has one), tokenized with the checkpoint's
tokenizer. A model trained on text continues held-out text the way the text repeats itself, so
prompt lookup's drafts get accepted there; a random-weight model's do not.

``--device cuda`` runs ``--preset`` (default ``kimi-k3-mid``) with dummy weights in ``--dtype``,
decode and verify steps as CUDA graphs; the draft-model rows need a checkpoint directory and are
left out there. The ``ngram, every draft right`` rows verify drafts scripted from plain decoding's
tokens (every one accepted): what prompt lookup gains on this model where it always finds the
continuation, the upper bound of its rows.

Also printed: the KDA rollback's memory per speculating sequence for the full presets, replay
(saved inputs + one pre-step state, what the engine does) against keeping the verify step's
per-position states.

    python bench/spec_decode.py [--quick] [--out FILE] [--num-draft-tokens K] [--repeats N]
                                [--checkpoint DIR] [--prompts-from DIR] [--methods ngram,draft,hidden]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    sys.modules.setdefault("triton", None)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, run_decode, write_json  # noqa: E402

from helixserve.config import CacheConfig  # noqa: E402
from helixserve.config_speculative import SpeculativeConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.models.presets import get_preset, make_checkpoint  # noqa: E402
from helixserve.models.tokenizer_loader import load_tokenizer  # noqa: E402
from helixserve.testing.drafts import ScriptedDrafter  # noqa: E402
from helixserve.training.checkpoint import TRAINING_LOG  # noqa: E402
from helixserve.training.corpus import held_out_texts  # noqa: E402
from helixserve.training.config import TrainingConfig  # noqa: E402


METHODS = ("ngram", "draft", "hidden")


def prompt_sets(batch: int, length: int, vocab: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    repetitive = []
    for _ in range(batch):
        pattern = [rng.randrange(vocab) for _ in range(rng.randrange(3, 7))]
        repetitive.append((pattern * length)[:length])
    return {"repetitive": repetitive, "random": [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]}


def held_out_prompts(ckpt: Path, root: Path, batch: int, length: int) -> list[list[int]]:
    """``batch`` windows of ``length`` ids spread over the held-out files under ``root``, in the
    checkpoint's tokenizer; the split is the training's (its ``training_log.json``) or the default."""
    log = ckpt / TRAINING_LOG
    tc = TrainingConfig.model_validate(json.loads(log.read_text())["config"]) if log.is_file() else TrainingConfig()
    tokenizer = load_tokenizer(ckpt)
    ids = [t for text in held_out_texts(root, tc) for t in tokenizer.encode(text)]
    if len(ids) < length + batch:
        raise SystemExit(f"--prompts-from {root}: {len(ids)} held-out tokens, too few for {batch} prompts of {length}")
    return [ids[s:s + length] for s in range(0, len(ids) - length, (len(ids) - length) // batch)][:batch]


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, list[list[int]]]:
    run = run_decode(llm.engine, [f"{tag}-{i}" for i in range(len(prompts))], prompts, params)
    return run.decode_tokens / run.decode_seconds, run.tokens


SCRIPTED = "ngram, every draft right"


def spec_engines(ckpt: Path, drafts: dict[str, Path], k: int, cache: CacheConfig, methods: tuple[str, ...],
                 **llm_kw: Any) -> dict[str, LLM]:
    """The speculating engines of the decode rows whose method is in ``methods``: n-gram lookup,
    and n-gram's verify steps with drafts scripted from plain decoding's tokens (``SCRIPTED``:
    every draft accepted, the upper bound of a prompt-lookup drafter on this model); and a model
    drafter per entry of ``drafts`` (its name starts with its method: the target's own weights as
    draft, every draft accepted, the upper bound; a trained draft or hidden drafter; another
    seed's weights)."""
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    engines = ({"ngram": LLM(ckpt, cache=cache, speculative=ngram, **llm_kw),
                SCRIPTED: LLM(ckpt, cache=cache, speculative=ngram, **llm_kw)} if "ngram" in methods else {})
    for name, draft in drafts.items():
        method = name.split(",")[0]
        if method in methods:
            spec = SpeculativeConfig(method=method, draft_model=draft, num_draft_tokens=k)
            engines[name] = LLM(ckpt, cache=cache, speculative=spec, **llm_kw)
    return engines


def spec_row(spec: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict[str, Any]:
    """One speculating engine's decode tok/s, tokens and acceptance over ``prompts``."""
    before = spec.engine.spec_stats
    drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
    per_pos, drafts = list(before.accepted_per_position), before.num_drafts
    rate, tokens = decode(spec, prompts, params, tag)
    stats = spec.engine.spec_stats
    n = stats.num_drafts - drafts
    positions = [(stats.accepted_per_position[j] - (per_pos[j] if j < len(per_pos) else 0)) / n
                 if n else 0.0 for j in range(len(stats.accepted_per_position))]
    new_drafted = stats.num_draft_tokens - drafted
    return {"spec_tok_s": rate, "tokens": tokens, "drafted": new_drafted,
            "acceptance": (stats.num_accepted_tokens - accepted) / new_drafted if new_drafted else 0.0,
            "acceptance_per_position": [round(p, 3) for p in positions]}


def rows_for(ckpt: Path, drafts: dict[str, Path], k: int, quick: bool, prompts_from: Path | None = None,
             methods: tuple[str, ...] = METHODS, **llm_kw: Any) -> list[dict[str, Any]]:
    cache = CacheConfig(tokens_per_block=16, max_num_seqs=8)
    plain = LLM(ckpt, cache=cache, **llm_kw)
    engines = spec_engines(ckpt, drafts, k, cache, methods, **llm_kw)
    params = SamplingParams(max_tokens=24 if quick else 64, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in (1, 8):
        sets = prompt_sets(batch, 64, plain.model_config.vocab_size, seed=batch)
        if prompts_from is not None:
            sets["held-out"] = held_out_prompts(ckpt, prompts_from, batch, 64)
        for name, prompts in sets.items():
            decode(plain, prompts[:1], params, "warm-plain")
            plain_rate, plain_tokens = decode(plain, prompts, params, f"plain-{name}-{batch}")
            script = {tuple(p): t for p, t in zip(prompts, plain_tokens, strict=True)}
            if SCRIPTED in engines:
                engines[SCRIPTED].engine.scheduler.drafter = ScriptedDrafter(k, script,
                                                                             vocab_size=plain.model_config.vocab_size)
            for method, spec in engines.items():
                decode(spec, prompts[:1], params, f"warm-{method}")
            for method, spec in engines.items():
                row = spec_row(spec, prompts, params, f"{method}-{name}-{batch}")
                rows.append({"method": method, "prompts": name, "batch": batch, "plain_tok_s": plain_rate,
                             "ratio": row["spec_tok_s"] / plain_rate, "equal": row.pop("tokens") == plain_tokens,
                             **row})
    return rows


def nothing_drafted_row(ckpt: Path, k: int, quick: bool, repeats: int, batch: int = 64, **llm_kw: Any) -> dict[str, Any]:
    """Plain vs speculative decode tok/s where the drafter finds nothing (see the module docstring)."""
    cache = CacheConfig(tokens_per_block=16, max_num_seqs=batch, memory_budget_mib=256 if not llm_kw else 8192)
    spec = LLM(ckpt, cache=cache, speculative=SpeculativeConfig(method="ngram", num_draft_tokens=k,
                                                                prompt_lookup_min=5, prompt_lookup_max=5), **llm_kw)
    engines = {"plain": LLM(ckpt, cache=cache, **llm_kw), "spec": spec, "control": LLM(ckpt, cache=cache, **llm_kw)}
    vocab = spec.model_config.vocab_size
    prompts = [random.Random(i).sample(range(vocab), 64) for i in range(batch)]  # distinct ids
    params = SamplingParams(max_tokens=16 if quick else 48, temperature=0.0, ignore_eos=True)
    for name, llm in engines.items():
        decode(llm, prompts[:1], params, f"warm-{name}")
    drafted = spec.engine.spec_stats.num_draft_tokens
    runs: dict[str, list[tuple[float, float, list[list[int]]]]] = {name: [] for name in engines}
    for i in range(repeats):
        for name, llm in engines.items():
            runs[name].append(cpu_timed_decode(llm, prompts, params, f"{name}-none-{i}"))
    best = {name: (max(r[0] for r in rs), max(r[1] for r in rs)) for name, rs in runs.items()}

    def ratio(name: str, clock: int) -> float:  # median over rounds of name / plain
        return statistics.median(r[clock] / p[clock] for r, p in zip(runs[name], runs["plain"]))
    return {"batch": batch, "plain_tok_s": best["plain"][0], "spec_tok_s": best["spec"][0],
            "ratio": ratio("spec", 0), "plain_tok_per_cpu_s": best["plain"][1],
            "spec_tok_per_cpu_s": best["spec"][1], "cpu_ratio": ratio("spec", 1),
            "control_ratio": ratio("control", 0), "control_cpu_ratio": ratio("control", 1),
            "equal": runs["spec"][-1][2] == runs["plain"][-1][2],
            "drafted": spec.engine.spec_stats.num_draft_tokens - drafted, "repeats": repeats,
            "max_new_tokens": params.max_tokens}


def cpu_timed_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str
                     ) -> tuple[float, float, list[list[int]]]:
    """Decode tok/s in wall time and per CPU second of this process (both over the decode steps)."""
    start: list[float] = []
    run = run_decode(llm.engine, [f"{tag}-{i}" for i in range(len(prompts))], prompts, params,
                     on_decode_start=lambda: start.append(time.process_time()))
    cpu = time.process_time() - start[0]
    return run.decode_tokens / run.decode_seconds, run.decode_tokens / cpu, run.tokens


def rollback_memory(k: int) -> list[dict[str, Any]]:
    """Bytes per speculating sequence over every KDA layer: replay vs per-position states."""
    out = []
    for preset in ("kimi-linear-48b", "kimi-k3"):
        cfg = get_preset(preset)
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        layers = len(cfg.kda_layer_ids)
        rows = k + 1
        state = H * K * K * 4
        conv = 3 * H * K * (cfg.conv_kernel_size - 1) * 2
        replay = layers * (rows * (3 * H * K * 2 + H * K * 4 + H * 4) + state + conv)
        per_position = layers * rows * state
        out.append({"preset": preset, "kda_layers": layers, "replay_mib": replay / 2**20,
                    "per_position_mib": per_position / 2**20})
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the batch-64 row (median ratio)")
    parser.add_argument("--device", default="cpu", help="cuda: --preset with dummy weights (n-gram rows only)")
    parser.add_argument("--preset", default="kimi-k3-mid", help="the preset on --device cuda")
    parser.add_argument("--dtype", default="bfloat16", help="the dtype on --device cuda")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint to run (default: a random-weight kimi-linear-tiny)")
    parser.add_argument("--prompts-from", type=Path, default=None, metavar="DIR",
                        help="add held-out prompts: the held-out files under DIR (make-checkpoint --train-on's split)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated drafters to run (ngram, draft, hidden); the nothing-drafted row needs ngram")
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        on_cuda = args.device.startswith("cuda")
        llm_kw = ({"device": args.device, "dtype": args.dtype, "load_format": "dummy"} if on_cuda else {})
        if on_cuda:  # dummy weights at the preset's shapes: no draft-model rows (they need a checkpoint)
            ckpt, drafts = Path(args.preset), {}
        else:
            ckpt = args.checkpoint or make_checkpoint("kimi-linear-tiny", Path(tmp) / "kimi-linear-tiny", seed=0)
            drafts = {"draft, same weights": ckpt}
            trained, hidden = ckpt / "draft", ckpt / "hidden"
            drafts.update({"draft, trained": trained} if trained.is_dir() else
                          {"draft, seed 1": make_checkpoint("kimi-linear-tiny", Path(tmp) / "seed1", seed=1)})
            drafts.update({"hidden, trained": hidden} if hidden.is_dir() else
                          {"hidden, seed 1": make_checkpoint("kimi-linear-tiny-hidden", Path(tmp) / "hidden", seed=1)})
        rows = rows_for(ckpt, drafts, args.num_draft_tokens, args.quick, args.prompts_from, methods, **llm_kw)
        none = (nothing_drafted_row(ckpt, args.num_draft_tokens, args.quick, args.repeats, **llm_kw)
                if "ngram" in methods else None)
    memory = rollback_memory(args.num_draft_tokens)
    name = (f"{args.preset} (dummy weights, {args.dtype})" if on_cuda else
            "kimi-linear-tiny (random weights)" if args.checkpoint is None else str(args.checkpoint))
    print(f"{name}, k = {args.num_draft_tokens}, {args.device}, {args.threads} threads")
    print(markdown_table(["method", "prompts", "batch", "plain tok/s", "spec tok/s", "ratio", "equal", "drafted",
                          "acceptance", "per position"],
                         [[r["method"], r["prompts"], r["batch"], r["plain_tok_s"], r["spec_tok_s"], r["ratio"], r["equal"],
                           r["drafted"], r["acceptance"], r["acceptance_per_position"]] for r in rows]))
    if none is not None:
        print_nothing_drafted(none)
    print()
    print(markdown_table(["preset", "KDA layers", "replay MiB/seq", "per-position states MiB/seq"],
                         [[m["preset"], m["kda_layers"], m["replay_mib"], m["per_position_mib"]] for m in memory]))
    write_json(args.out, {"machine": machine_info(), "checkpoint": name, "num_draft_tokens": args.num_draft_tokens,
                          "decode": rows, "nothing_drafted": none, "rollback_memory": memory})


def print_nothing_drafted(none: dict[str, Any]) -> None:
    print()
    print(f"nothing drafted (5-gram lookup over distinct ids), batch {none['batch']}, median of {none['repeats']} rounds")
    print(markdown_table(["batch", "plain tok/s", "spec tok/s", "ratio", "plain tok/CPU s", "spec tok/CPU s",
                          "CPU ratio", "plain/plain (noise)", "equal", "drafted"],
                         [[none["batch"], none["plain_tok_s"], none["spec_tok_s"], none["ratio"],
                           none["plain_tok_per_cpu_s"], none["spec_tok_per_cpu_s"], none["cpu_ratio"],
                           f"{none['control_ratio']:.2f} / {none['control_cpu_ratio']:.2f}",
                           none["equal"], none["drafted"]]]))


if __name__ == "__main__":
    main()
