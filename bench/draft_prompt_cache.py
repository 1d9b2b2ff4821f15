"""A drafter's prompt cache on the gen side: rebuilt there against transferred from the ctx worker.

**Draft model** (``method: draft``): rebuilt (the gen world's leader runs the received prompt
through the draft model when the request starts, what helixserve does) against transferred (the
ctx worker would run the draft too and send its cache with the target's).

Per draft model and prompt length: the draft's prefill on this device (the rebuild, eager, median
of ``--reps``), the bytes its prompt cache would add to the transfer (MLA pages of every prompt
token and one full-head KDA state + conv slot, :func:`~helixserve.planning.memory.pool_unit_bytes`)
next to the target's prompt cache bytes, the transfer time of those extra bytes at ``--gbps``, and
the ratio rebuild / transfer. The draft models are two-layer cuts of the presets (one KDA, one
MLA layer: :func:`~helixserve.models.presets.two_layer_draft`), dummy weights; on CPU the tiny
ones, on a GPU also Kimi-Linear-48B's cut in bfloat16.

**Hidden-state drafter** (``method: hidden``): the target's hidden states of the prompt are on the
ctx worker only. Four ways to the drafter's prompt cache, per prompt length: (a) the drafter's
forward over the prompt tokens with zero features on the gen (its time measured; exact output,
drafts may differ from an aggregated run's: the fallback when the ctx sends none); (b) the exact
features rebuilt by the target's prefill on the gen (its time measured: the ctx worker's work done
twice); (c) the features sent with the request: ``prompt_len x layers x hidden x itemsize`` bytes,
and their transfer time at ``--gbps``; (d) what helixserve does with a drafter on both sides: the
ctx worker runs the drafter over the prompt with the target's features (the forward of (a), timed
against the target's prefill there) and sends the drafter's cache, its MLA pages of every prompt
token plus one feature row (bytes per prompt token shown). One-layer drafters of the presets
reading three target layers (:func:`~helixserve.models.presets.hidden_drafter_preset`), dummy
weights: on CPU K3-tiny's, on a GPU also K3-mid's in bfloat16; K3's bytes are arithmetic (not run).

Acceptance, with ``--checkpoint DIR --prompts-from DIR`` (a pair that ``helixserve make-checkpoint
--train-on`` trained, ``DIR/hidden`` its drafter; held-out prompts as ``bench/spec_decode.py``
takes them): greedy decoding of the prompts at once, the drafter's prompt cache as an aggregated
engine writes it (the target's features), as (d) installs it (after the prefill step the engine's
own ``hold`` completes it as a ctx worker does and ``prefill`` installs it as the gen world's
leader does, from the same pools), and rewritten by ``HiddenDraftRunner.prefill`` from zero
features (a); acceptance of each, and whether their tokens are equal.

    python bench/draft_prompt_cache.py [--quick] [--out FILE] [--gbps 25] [--reps 5]
                                       [--checkpoint DIR --prompts-from DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.modules.setdefault("triton", None)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, gpu_timer, machine_info, markdown_table, write_json  # noqa: E402
from spec_decode import held_out_prompts  # noqa: E402

import tempfile  # noqa: E402

from helixserve.cache_layout import cache_spec_for  # noqa: E402
from helixserve.config_speculative import SpeculativeConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.engine.runner import ModelRunner, PreparedStep, build_forward_batch  # noqa: E402
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput  # noqa: E402
from helixserve.kvcache.pools import allocate_model_caches  # noqa: E402
from helixserve.models.config import KimiModelConfig  # noqa: E402
from helixserve.models.dummy import load_dummy_model  # noqa: E402
from helixserve.models.hidden_drafter import HiddenDrafter, load_hidden_drafter, save_hidden_drafter  # noqa: E402
from helixserve.models.hidden_drafter_config import hidden_drafter_config  # noqa: E402
from helixserve.models.presets import PRESETS, hidden_drafter_preset, init_random_weights, two_layer_draft  # noqa: E402
from helixserve.planning.memory import MIB, pool_unit_bytes  # noqa: E402

TPB = 64


def prompt_cache_bytes(cfg: KimiModelConfig, itemsize: int, num_tokens: int) -> int:
    block, slot = pool_unit_bytes(cfg, itemsize, TPB)
    return -(-num_tokens // TPB) * block + slot


def rebuild_seconds(cfg: KimiModelConfig, dtype: torch.dtype, device: torch.device, num_tokens: int,
                    reps: int) -> float:
    """The draft model's prefill of ``num_tokens`` tokens (one chunk, no LM head), median seconds."""
    model = load_dummy_model(cfg, dtype, device)
    num_blocks = -(-num_tokens // TPB)
    caches = allocate_model_caches(cache_spec_for(cfg, dtype, TPB), num_blocks, 1, device)
    runner = ModelRunner(model, caches, device)
    prompt = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = ScheduledSeq("r", prompt, 0, list(range(num_blocks)), 0, is_prefill=True, sample=False)

    def run() -> None:
        with torch.inference_mode():
            runner.run(PreparedStep(build_forward_batch(SchedulerOutput(seqs=[seq]), device), [0], None))

    return gpu_timer([run], warmup=1, reps=reps)[0]


def hidden_rebuild_seconds(drafter_raw: dict, dtype: torch.dtype, device: torch.device, num_tokens: int,
                           reps: int) -> float:
    """The hidden drafter's forward over ``num_tokens`` prompt tokens with zero features (what
    ``HiddenDraftRunner.prefill`` runs), median seconds."""
    cfg, spec = hidden_drafter_config(drafter_raw)
    drafter = HiddenDrafter(cfg, spec, dtype=torch.float32)
    init_random_weights(drafter, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_hidden_drafter(save_hidden_drafter(drafter, tmp), dtype=dtype, device=device)
    num_blocks = -(-num_tokens // TPB)
    caches = allocate_model_caches(cache_spec_for(cfg, dtype, TPB), num_blocks, 0, device)
    prompt = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = ScheduledSeq("r", prompt, 0, list(range(num_blocks)), None, is_prefill=True, sample=False)
    zeros = torch.zeros(num_tokens, spec.feature_size, dtype=dtype, device=device)

    def run() -> None:
        with torch.inference_mode():
            model(build_forward_batch(SchedulerOutput(seqs=[seq]), device), caches, model.fuse(zeros))

    return gpu_timer([run], warmup=1, reps=reps)[0]


def hidden_rows(preset: str, lengths: list[int], dtype: torch.dtype, device: torch.device | None, reps: int,
                gbps: float) -> tuple[list[list], list[dict]]:
    """Table rows and figures of a hidden drafter reading three layers of ``preset`` (timed when
    ``device`` is given)."""
    target = KimiModelConfig.model_validate(PRESETS[preset])
    last = target.num_hidden_layers - 1
    raw = hidden_drafter_preset(PRESETS[preset], [1, last // 2, last])
    drafter_cfg, spec = hidden_drafter_config(raw)
    rows, figures = [], []
    for n in lengths:
        features = n * spec.feature_size * dtype.itemsize
        drafter_cache = prompt_cache_bytes(drafter_cfg, dtype.itemsize, n)
        target_cache = prompt_cache_bytes(target, dtype.itemsize, n)
        drafter_ms = target_ms = None
        if device is not None:
            drafter_ms = hidden_rebuild_seconds(raw, dtype, device, n, reps) * 1e3
            target_ms = rebuild_seconds(target, dtype, device, n, reps) * 1e3
        transfer_ms = features / (gbps * 1e9) * 1e3
        sent = drafter_cache + len(spec.hidden_layers) * target.hidden_size * dtype.itemsize  # (d): + one feature row
        figures.append({"preset": preset, "prompt_tokens": n, "zero_feature_rebuild_ms": drafter_ms,
                        "target_prefill_ms": target_ms, "feature_bytes": features,
                        "drafter_cache_bytes": drafter_cache, "target_cache_bytes": target_cache,
                        "feature_transfer_ms": transfer_ms, "sent_drafter_cache_bytes": sent,
                        "sent_bytes_per_token": sent / n, "sent_transfer_ms": sent / (gbps * 1e9) * 1e3})
        shown = [f"{preset} {dtype.itemsize * 8}-bit", n, "-" if drafter_ms is None else drafter_ms,
                 "-" if target_ms is None else target_ms, features / MIB, f"{features / target_cache:.1%}",
                 transfer_ms, f"{sent / n:,.0f}", f"{sent / target_cache:.1%}",
                 "-" if drafter_ms is None or target_ms is None else f"{drafter_ms / target_ms:.2f}"]
        rows.append(shown)
    return rows, figures


def hidden_acceptance(ckpt: Path, prompts: list[list[int]], k: int, max_tokens: int) -> dict[str, dict]:
    """Acceptance of ``ckpt``'s trained hidden drafter on ``prompts`` (greedy, one batch), its
    prompt cache from the target's features (aggregated) and from zero features (rewritten after
    the prefill step, as a disaggregated gen world's leader writes it); each one's tokens."""
    spec = SpeculativeConfig(method="hidden", draft_model=ckpt / "hidden", num_draft_tokens=k)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for mode in ("aggregated", "(d) ctx's drafter cache", "(a) zero-feature prompt cache"):
        engine = LLM(ckpt, speculative=spec).engine
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        num_steps = 0
        while engine.has_unfinished_requests():
            for update in engine.step():
                tokens[update.request_id].append(update.token_id)
            num_steps += 1
            if num_steps == 1 and mode != "aggregated":
                if mode.startswith("(d)"):  # the ctx's completion of a held prefill, then the gen leader's install
                    engine.draft_runner.hold(ids)
                    engine.draft_runner.prompt_cache.received.update(ids)
                for rid, prompt in zip(ids, prompts):
                    request = engine.scheduler.get_request(rid)
                    assert request is not None and request.num_computed_tokens == len(prompt), "prefill in one step"
                    engine.draft_runner.prefill(request, len(prompt))
        stats = engine.spec_stats
        out[mode] = {"num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
                     "acceptance": stats.num_accepted_tokens / max(1, stats.num_draft_tokens),
                     "accepted_per_position": stats.accepted_per_position, "num_drafts": stats.num_drafts,
                     "tokens": [tokens[rid] for rid in ids]}
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=25.0, help="transfer bandwidth, GB/s (cross-host UCX)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a trained pair (DIR/hidden its drafter)")
    parser.add_argument("--prompts-from", type=Path, default=None, metavar="DIR",
                        help="with --checkpoint: held-out prompts from the files under DIR (its training split)")
    args = parser.parse_args()
    is_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if is_cuda else "cpu")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    cases = [("kimi-k3-tiny", [512] if args.quick else [512, 4096])]
    if is_cuda:
        cases.append(("kimi-linear-48b", [512, 4096] if args.quick else [512, 4096, 32768]))
    rows, figures = [], []
    for preset, lengths in cases:
        target = KimiModelConfig.model_validate(PRESETS[preset])
        draft = KimiModelConfig.model_validate(two_layer_draft(PRESETS[preset]))
        for n in lengths:
            seconds = rebuild_seconds(draft, dtype, device, n, 2 if args.quick else args.reps)
            extra = prompt_cache_bytes(draft, dtype.itemsize, n)
            target_bytes = prompt_cache_bytes(target, dtype.itemsize, n)
            transfer = extra / (args.gbps * 1e9)
            figures.append({"preset": preset, "prompt_tokens": n, "rebuild_ms": seconds * 1e3,
                            "draft_cache_bytes": extra, "target_cache_bytes": target_bytes,
                            "transfer_ms": transfer * 1e3})
            rows.append([f"{preset} 2-layer draft", n, seconds * 1e3, extra / MIB, target_bytes / MIB,
                         f"{extra / target_bytes:.1%}", transfer * 1e3, seconds / transfer])
    headers = ["draft", "prompt tokens", "rebuild ms", "draft cache MiB", "target cache MiB", "extra bytes",
               f"transfer ms at {args.gbps:g} GB/s", "rebuild / transfer"]
    print(markdown_table(headers, rows))
    reps = 2 if args.quick else args.reps
    hidden = [hidden_rows("kimi-k3-tiny", [512] if args.quick else [512, 4096], dtype, device, reps, args.gbps),
              hidden_rows("kimi-k3", [4096, 32768], torch.bfloat16, None, reps, args.gbps)]
    if is_cuda:
        hidden.insert(1, hidden_rows("kimi-k3-mid", [512, 4096] if args.quick else [512, 4096, 32768], dtype,
                                     device, reps, args.gbps))
    print()
    print(markdown_table(["hidden drafter of", "prompt tokens", "(a), (d) drafter forward ms",
                          "(b) target prefill ms", "(c) features MiB", "features / target cache",
                          f"(c) transfer ms at {args.gbps:g} GB/s", "(d) bytes / token", "(d) / target cache",
                          "(d) drafter / target prefill"],
                         [r for part in hidden for r in part[0]]))
    acceptance = None
    if args.checkpoint is not None and args.prompts_from is not None:
        prompts = held_out_prompts(args.checkpoint, args.prompts_from, 4 if args.quick else 8, 64)
        acceptance = hidden_acceptance(args.checkpoint, prompts, 3, 12 if args.quick else 24)
        print()
        print(markdown_table(["hidden drafter's prompt cache", "drafts", "accepted", "acceptance", "per position",
                              "tokens equal the aggregated"],
                             [[mode, a["num_draft_tokens"], a["num_accepted_tokens"], a["acceptance"],
                               ", ".join(f"{n / max(1, a['num_drafts']):.2f}" for n in a["accepted_per_position"]),
                               a["tokens"] == acceptance["aggregated"]["tokens"]] for mode, a in acceptance.items()]))
    write_json(args.out, {"machine": machine_info(), "gbps": args.gbps, "dtype": str(dtype), "rows": figures,
                          "hidden_rows": [f for part in hidden for f in part[1]], "hidden_acceptance": acceptance})


if __name__ == "__main__":
    main()
