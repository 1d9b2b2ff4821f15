"""GPU kernels and the GPU engine on one H200, each figure next to its baseline from the same run.

- HBM copy: a 4 GiB device-to-device copy, bytes read + written per second (the roofline below).
- KDA prefill (T = 4k, 16k, 64k; H 32, K = V = 128, bf16) and decode (B = 64, 256, 1024, states
  at scattered pool slots) through ``helixserve.kernels`` vs calling fla directly with the same
  tensors: the wrapper's cost (target < 3 %).
- Paged MLA decode (bf16 latent cache 512 + 64, shuffled 64- and 16-token pages): unique bytes read over
  time as a fraction of the copy bandwidth (target >= 80 %); the default launch and the best of a
  sweep of tile shapes with --mla-sweep (block_n, block_h, warps, stages, splits). On 64-token pages,
  where the library is built (``make flashmla``) and the GPU is sm90, the FlashMLA backend's row
  beside ours (``kernels.mla.flashmla.paged_decode``: table compaction, metadata, kernel, combine).
- MoE: the routed experts of K3 shape (3584 -> 2 x 3072 -> 3584, 64 local experts, top-8) as two
  ``torch._grouped_mm`` calls vs dense bf16 GEMMs of the same FLOPs; plus the full ``moe_experts``.
- ``kimi-k3-mid`` through the engine (``LLM``, what ``helixserve generate`` runs): prefill tok/s
  (one 2048-token prompt), decode tok/s at batch 1 and 64 (CUDA graphs), and the share of a decode
  step's wall time (``EngineCore.step``) outside its GPU-busy span, from the CUDA-graph launch to
  the sampler's last kernel (target < 10 %).
- The same engine as a gen world of one (dp 1 x cp 1, ``start_local_world``: this process its only
  rank) against ``LLM`` on the same checkpoint and settings, in the same run: decode tok/s at batch
  1 and 64 (64-token prompts, 128 new tokens), ratio world / single (target >= 0.95) and the host
  share of a world step as above (target < 10 %; "world" rows).

Timing: CUDA events, median of repetitions after warm-up, the two sides of a ratio alternating;
each repetition is queued behind a ~1 ms GPU sleep, so the events time the GPU work and not the
host's launch latency (decode steps run as CUDA graphs, where no launch latency exists).
Without CUDA, ``--quick`` times the PyTorch references on tiny shapes instead and marks the GPU rows
skipped (the numbers are then CPU figures, not the H200 ones).

- Decode MBU ("mbu" rows, ``--only mbu``): ``kimi-k3-mid`` and ``kimi-linear-48b`` with dummy
  weights (``model.load_format: dummy``, bf16) at batch 1 / 8 / 64, decode tok/s and the bytes a
  step must read over the step time as a share of the copy bandwidth (``bench/_mbu.py`` says what
  is counted); the JSON's ``results`` holds these rows (``model``, ``batch``, ``tok_s``, ``mbu``).

    python bench/kernels.py [--quick] [--out FILE] [--only kda,mla,moe,engine,mbu]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, gpu_timer as timer, machine_info, markdown_table, run_decode, write_json  # noqa: E402
from _decode_rate import decode_rate, find_runner  # noqa: E402
from _mbu import mbu_rows  # noqa: E402
from _moe_rows import moe_rows  # noqa: E402

from helixserve import kernels  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402

ROWS: list[dict[str, Any]] = []
GiB = 1 << 30


def row(section: str, case: str, ours: float | None, base: float | None, unit: str, base_name: str,
        ratio: str | None = None, note: str = "", **extra: Any) -> None:
    ROWS.append({"section": section, "case": case, "ours": ours, "baseline": base, "unit": unit,
                 "baseline_is": base_name, "ratio": ratio, "note": note, **extra})
    print(f"  {section:<8} {case:<34} {ours if ours is not None else '-'!s:>12} {unit:<6} "
          f"| {base_name}: {base if base is not None else '-'!s:>10} {ratio or ''} {note}", flush=True)




def copy_bandwidth(args) -> float:
    n = (4 * GiB if not args.quick else GiB) // 2
    src = torch.randn(n // 2, dtype=torch.float32, device="cuda").view(torch.bfloat16)
    dst = torch.empty_like(src)
    (t,) = timer([lambda: dst.copy_(src)], 3, 20)
    bw = 2 * src.numel() * src.element_size() / t
    row("hbm", f"copy {src.numel() * 2 / GiB:.0f} GiB", bw / 1e12, None, "TB/s", "-")
    return bw


def kda_inputs(T: int, H: int, K: int, device: str, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(T)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    q, k, v = (rand(T, H, K).to(dtype) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen, device=device) * 0.5 - 0.01
    beta = torch.rand(T, H, generator=gen, device=device)
    return q, k, v, g, beta


def bench_kda(args, on_gpu: bool) -> None:
    H, K = (32, 128) if on_gpu else (4, 32)
    lengths = (4096, 16384, 65536) if on_gpu and not args.quick else ((4096,) if on_gpu else (256,))
    for T in lengths:
        q, k, v, g, beta = kda_inputs(T, H, K, "cuda" if on_gpu else "cpu")
        cu = torch.tensor([0, T], device=q.device)

        def ours():
            return kernels.kda_chunk_prefill(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True)

        if not on_gpu:
            (t,) = timer([ours], 1, 3)
            row("kda", f"prefill T={T} H={H} (cpu torch)", T / t, None, "tok/s", "fla (skipped: no CUDA)")
            continue
        from fla.ops.kda import chunk_kda

        def fla():
            return chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=K**-0.5,
                             output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

        t_ours, t_fla = timer([ours, fla], 3, args.reps)
        row("kda", f"prefill T={T // 1024}k H={H} K=V={K}", t_ours * 1e3, t_fla * 1e3, "ms", "fla chunk_kda",
            f"{t_ours / t_fla - 1:+.1%}")
    batches = (64, 256, 1024) if on_gpu and not args.quick else ((64, 256) if on_gpu else (8,))
    for B in batches:
        q, k, v, g, beta = kda_inputs(B, H, K, "cuda" if on_gpu else "cpu")
        slots = torch.randperm(B + 7, device=q.device)[:B]
        pool = torch.randn(B + 7, H, K, K, device=q.device) * 0.01

        def ours_step():
            return kernels.kda_recurrent_step(q, k, v, g, beta, pool, slots, use_qk_l2norm=True)

        if not on_gpu:
            (t,) = timer([ours_step], 1, 3)
            row("kda", f"decode B={B} H={H} (cpu torch)", t * 1e6, None, "µs", "fla (skipped: no CUDA)")
            continue
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        q4, k4, v4, g4, b4 = (t.unsqueeze(1).contiguous() for t in (q, k, v, g, beta))

        def fla_step():
            return fused_recurrent_kda_fwd(q4, k4, v4, g4, b4, scale=K**-0.5, initial_state=pool,
                                           inplace_final_state=True, ssm_state_indices=slots,
                                           use_qk_l2norm_in_kernel=True)

        t_ours, t_fla = timer([ours_step, fla_step], 5, args.reps * 4)
        state_bytes = 2 * B * H * K * K * 4
        row("kda", f"decode B={B} H={H} K=V={K}", t_ours * 1e6, t_fla * 1e6, "µs", "fla fused_recurrent",
            f"{t_ours / t_fla - 1:+.1%}", f"state {state_bytes / t_ours / 1e12:.2f} TB/s")


def mla_case(B: int, kv_len: int, H: int, BS: int, device: str, dtype=torch.bfloat16):
    blocks_per_seq = -(-kv_len // BS)
    num_blocks = B * blocks_per_seq
    cache = torch.randn(num_blocks, BS, 576, device=device).to(dtype)
    tables = torch.randperm(num_blocks, device=device).view(B, blocks_per_seq).to(torch.int32)
    q = torch.randn(B, H, 576, device=device).to(dtype)
    cu = torch.arange(B + 1, device=device)
    kv_lens = torch.full((B,), kv_len, device=device)
    return q, cache, tables, cu, kv_lens - 1, kv_lens


def bench_mla(args, on_gpu: bool, copy_bw: float | None) -> None:
    if not on_gpu:
        args_ = mla_case(4, 512, 4, 16, "cpu", torch.float32)
        (t,) = timer([lambda: kernels.mla_paged_attention(*args_, scale=0.07, v_dim=512)], 1, 3)
        row("mla", "decode B=4 kv=512 H=4 (cpu torch)", t * 1e6, None, "µs", "HBM copy (skipped: no CUDA)")
        return
    from helixserve.kernels.mla import triton_mla

    # (batch, kv_len, heads, sweep tile shapes)
    # (batch, kv_len, heads, page size, sweep tile shapes); 16-token pages are the engine's default
    shapes = [(64, 4096, 16, 64, True), (256, 4096, 16, 64, False), (64, 16384, 16, 64, False),
              (128, 4096, 64, 64, True), (64, 4096, 16, 16, False), (128, 4096, 64, 16, False),
              (128, 16384, 96, 64, False), (128, 16384, 128, 64, False)]
    if args.quick:
        shapes = shapes[:1]
    for B, kv_len, H, page, do_sweep in shapes:
        # key tile (block_n) x heads per program x warps x pipeline stages; value-column splits
        # (dv_parts 2, 4) lost at every shape of the first sweep and are left out
        sweep = [dict(block_n=bn, block_h=bh, dv_parts=1, num_warps=w, num_stages=st)
                 for bn in (16, 32, 64) for bh in (16, 32) if bh <= max(16, H) for w in (4, 8) for st in (2, 3, 4)]
        case = mla_case(B, kv_len, H, page, "cuda")
        nbytes = B * kv_len * 576 * 2 + 2 * B * H * 576 * 2

        def run(**kw):
            return triton_mla.paged_attention(*case, 192**-0.5, 512, **kw)

        (t_default,) = timer([lambda: kernels.mla_paged_attention(*case, scale=192**-0.5, v_dim=512)], 3, args.reps * 4)
        best = (t_default, "default")
        # without --mla-sweep: the two tile shapes the defaults choose between (64-key tiles in 2
        # stages on 64-token pages, 32-key tiles in 3 stages otherwise)
        tiles = [dict(block_n=32, num_stages=3), dict(block_n=64, num_stages=2)]
        for kw in sweep if do_sweep and args.mla_sweep else tiles:
            splits = triton_mla.choose_num_splits(B, -(-H // kw.get("block_h", triton_mla._block_h(H)))
                                                  * kw.get("dv_parts", 1))
            for ns in sorted({splits, 2 * splits}):
                try:
                    (t,) = timer([lambda: run(num_splits=ns, **kw)], 2, args.reps * 2)
                except Exception as exc:  # a tile shape over the shared-memory limit
                    print(f"    sweep {kw} splits={ns}: {type(exc).__name__}", flush=True)
                    continue
                print(f"    sweep B={B} H={H} {kw} splits={ns}: {nbytes / t / 1e12:.2f} TB/s", flush=True)
                if t < best[0]:
                    best = (t, f"{kw} splits={ns}")
        for label, t in (("default", t_default), ("best", best[0])):
            bw = nbytes / t
            row("mla", f"decode B={B} kv={kv_len // 1024}k H={H} page={page} {label}", bw / 1e12, copy_bw / 1e12,
                "TB/s", "HBM copy", f"{bw / copy_bw:.0%}",
                f"{t * 1e6:.0f} µs" + (f" {best[1]}" if label == "best" else ""))
        if page == 64:
            bench_flashmla(args, case, f"decode B={B} kv={kv_len // 1024}k H={H} page={page}", nbytes, t_default,
                           copy_bw)


def bench_flashmla(args, case: tuple, name: str, nbytes: int, t_ours: float, copy_bw: float) -> None:
    """FlashMLA's row for one MLA decode case (64-token pages), beside our default launch's time."""
    from helixserve.kernels.mla import flashmla

    q, cache, tables, _, _, kv_lens = case
    reason = flashmla.unavailable_reason(q.device) or flashmla.unsupported_reason(q, cache, tables, kv_lens, 512)
    if reason is not None:
        print(f"    flashmla skipped: {reason}", flush=True)
        return
    (t,) = timer([lambda: flashmla.paged_decode(q, cache, tables, kv_lens, 192**-0.5)], 3, args.reps * 4)
    bw = nbytes / t
    row("mla", f"{name} flashmla", bw / 1e12, copy_bw / 1e12, "TB/s", "HBM copy", f"{bw / copy_bw:.0%}",
        f"{t * 1e6:.0f} µs; ours (default) / flashmla {t_ours / t:.2f}×")


def bench_engine(args, on_gpu: bool, checkpoint: Path | None) -> None:
    from helixserve.config import CacheConfig, SchedulerConfig
    from helixserve.engine.llm import LLM
    from helixserve.engine.world_rank import WorldOptions
    from helixserve.models.presets import make_checkpoint

    preset = "kimi-k3-mid" if on_gpu else "kimi-k3-tiny"
    with tempfile.TemporaryDirectory(prefix="helix-kbench-") as tmp:
        if checkpoint is None:
            checkpoint = make_checkpoint(preset, Path(tmp) / preset, dtype="bfloat16" if on_gpu else "float32")
        prompt_len = 2048 if on_gpu else 128
        max_batch = 64 if on_gpu else 4
        cache = CacheConfig(max_num_seqs=max_batch, memory_budget_mib=4096 if on_gpu else 256,
                            tokens_per_block=args.tokens_per_block)
        scheduler = SchedulerConfig(max_num_batched_tokens=prompt_len)
        llm = LLM(checkpoint, device="cuda" if on_gpu else "cpu", cache=cache, scheduler=scheduler)
        gen = torch.Generator().manual_seed(0)
        one = SamplingParams(max_tokens=1, ignore_eos=True)

        def prefill():
            llm.generate([torch.randint(0, 256, (prompt_len,), generator=gen).tolist()], one)

        (t,) = timer([prefill], 1, 3 if args.quick else 5)
        pages = f" (pages of {args.tokens_per_block})"
        row("engine", f"{preset} prefill bs1×{prompt_len}{pages}", prompt_len / t, None, "tok/s", "-")
        runner = find_runner(llm.engine)
        for batch in (1, max_batch):
            prompts = torch.randint(0, 256, (batch, 128), generator=gen).tolist()
            tok_s, outside = decode_rate(llm.engine, prompts, 16 if args.quick else 64, f"kb-{batch}", runner)
            row("engine", f"{preset} decode bs{batch}{pages}", tok_s, None, "tok/s", "-",
                note=f"outside GPU kernels {outside:.1%}" if outside is not None else "")
        bench_world(args, on_gpu, preset, checkpoint, llm, (1, max_batch),
                    WorldOptions(cache=cache, scheduler=scheduler, dtype="bfloat16" if on_gpu else "float32"))


def bench_world(args, on_gpu: bool, preset: str, checkpoint: Path, llm, batches: tuple[int, ...], options) -> None:
    """A gen world of one (dp 1 x cp 1, this process its only rank) against ``llm`` on the same
    checkpoint and settings: decode tok/s of 64-token prompts (128 new tokens; 32 with --quick, 16
    on CPU), the two sides alternating (median of 1 after a warm-up with --quick, else of 3); ratio
    world / single (target >= 0.95) and each side's host share (target < 10 % for the world)."""
    from helixserve.serving.local_world import start_local_world

    new_tokens = 16 if not on_gpu else 32 if args.quick else 128
    reps = 1 if args.quick or not on_gpu else 3
    gen = torch.Generator().manual_seed(18)
    world = start_local_world(checkpoint, dp=1, cp=1, options=options)
    try:
        sides = {"single": llm.engine, "world": world.driver}
        runners = {side: find_runner(engine) for side, engine in sides.items()}
        for batch in batches:
            prompts = torch.randint(0, 256, (batch, 64), generator=gen).tolist()
            rates: dict[str, list[tuple[float, float | None]]] = {side: [] for side in sides}
            for rep in range(1 + reps):  # the first round warms up (graph capture, allocator)
                for side, engine in sides.items():
                    rate = decode_rate(engine, prompts, new_tokens, f"kw-{side}-{batch}-{rep}", runners[side])
                    if rep:
                        rates[side].append(rate)
            (single, single_out), (world_tok_s, world_out) = (_median_rate(rates[s]) for s in ("single", "world"))
            note = "world step outside GPU kernels " + (
                f"{world_out:.1%}" if world_out is not None
                else "n/a (no CUDA-graph runner found)" if on_gpu else "n/a (CPU: no CUDA graphs)")
            if single_out is not None:
                note += f"; single {single_out:.1%}"
            row("engine", f"{preset} world decode bs{batch}", world_tok_s, single, "tok/s", "single engine (LLM)",
                f"{world_tok_s / single:.2f}×", note, ratio_value=world_tok_s / single,
                world_outside=world_out, single_outside=single_out, new_tokens=new_tokens, prompt_len=64)
        _world_prefill(args, on_gpu, preset, sides, gen)
    finally:
        world.close()


def _world_prefill(args, on_gpu: bool, preset: str, sides: dict, gen: torch.Generator) -> None:
    """The world of one as a ctx world of one: the same batch prefilled (one greedy token each)
    by it and by the single engine, alternating; tok/s = prompt tokens / seconds of the median
    repetition, ratio world / single (target >= 0.95)."""
    batch, length = (4, 2048) if on_gpu else (2, 128)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    firsts: dict[str, list[list[int]]] = {}
    for rep in range(1 + (2 if args.quick else 5)):
        prompts = torch.randint(0, 256, (batch, length), generator=gen).tolist()
        for side, engine in sides.items():
            start = time.perf_counter()
            firsts[side] = run_decode(engine, [f"kp-{side}-{rep}-{i}" for i in range(batch)], prompts, one).tokens
            if rep:  # the first round warms up
                seconds[side].append(time.perf_counter() - start)
    world_tok_s, single = (batch * length / statistics.median(seconds[s]) for s in ("world", "single"))
    same = sum(a == b for a, b in zip(firsts["world"], firsts["single"], strict=True))
    row("engine", f"{preset} ctx world of one prefill {batch}×{length}", world_tok_s, single, "tok/s",
        "single engine (LLM)", f"{world_tok_s / single:.2f}×", f"first tokens equal {same}/{batch}",
        ratio_value=world_tok_s / single, prompt_len=length, batch=batch)


def _median_rate(rates: list[tuple[float, float | None]]) -> tuple[float, float | None]:
    shares = [o for _, o in rates if o is not None]
    return statistics.median(r for r, _ in rates), statistics.median(shares) if shares else None


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="kda,mla,moe,engine,mbu")
    parser.add_argument("--checkpoint", type=Path, default=None, help="an existing kimi-k3-mid bf16 checkpoint")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--tokens-per-block", type=int, default=16, help="the engine rows' cache page size")
    parser.add_argument("--mla-sweep", action="store_true",
                        help="also time a grid of MLA tile shapes (block_h, dv_parts, warps, stages, splits)")
    args = parser.parse_args()
    args.reps = args.reps or (5 if args.quick else 20)
    on_gpu = torch.cuda.is_available()
    only = set(args.only.split(","))
    started = time.perf_counter()
    if not on_gpu:
        print("no CUDA: timing the PyTorch references on tiny shapes; GPU baselines skipped", flush=True)
    copy_bw = copy_bandwidth(args) if on_gpu and only & {"mla", "mbu"} else None
    if "kda" in only:
        bench_kda(args, on_gpu)
    if "mla" in only:
        bench_mla(args, on_gpu, copy_bw)
    if "moe" in only:
        moe_rows(args, on_gpu, row)
    if "engine" in only:
        bench_engine(args, on_gpu, args.checkpoint)
    if "mbu" in only:
        mbu_rows(args.quick, on_gpu, copy_bw, row)
    info = machine_info()
    if on_gpu:
        info["gpu"] = torch.cuda.get_device_name()
    headers = ["section", "case", "ours", "baseline", "unit", "baseline is", "ratio / overhead", "note"]
    table = markdown_table(headers, [[r["section"], r["case"], r["ours"], r["baseline"], r["unit"], r["baseline_is"],
                                      r["ratio"], r["note"]] for r in ROWS])
    print(f"\n{info.get('gpu') or info['processor']}, torch {info['torch']}, {time.perf_counter() - started:.0f} s\n")
    print(table)
    write_json(args.out, {"machine": info, "rows": ROWS, "table": table,
                          "results": [r for r in ROWS if r["section"] == "mbu"]})


if __name__ == "__main__":
    main()
