"""Host cost of planning and launching one pulled shard's copy, next to the launch floor.

A gen rank that pulls a request's shard out of a ctx's opened pools (`transceiver.gen.pull`) spends,
on its engine thread: its own plan (``ShardPlan.for_receiver`` at request start: the stream's
segments and messages; no memory map is built for a pull), the unit groups of the shard (the
cached ``PullPair`` of the two pool sets, then ``groups``: the two block tables times the block
size, the two slots), and issuing the copy (``UnitCopier.copy``: the request table's pack and
upload, the kernel launch on CUDA; the reference copy on the CPU). The copy itself runs on the
device afterwards. Each phase is timed on the host, median of ``--reps`` after warm-up; the total
is the sum of the phase medians. The planning phases run back to back per repetition; the issue
is timed in a second loop, taking turns with the baseline (a CPU run's reference copy would
otherwise flush the caches the next plan reads). On CUDA ``torch.cuda.synchronize`` runs only
outside the timed sections, so "issue" is the launch, not the kernel. Same-run baseline: one
``UnitCopier.copy`` of a single unit of the same byte count (the floor any launch pays). Also timed: the
planning phases **cold** (before each repetition 64 MiB are read, evicting the CPU caches, and
other Python work runs, as between two requests of a serving gen rank, where each request's
steps run once). On CUDA also: the copy's GPU time (CUDA events, launched behind a 1 ms GPU
sleep so the host does not bound it) next to one ``copy_`` of the same number of contiguous bytes.

Shapes: kimi-k3-mid 512 and 4096 prompt tokens, kimi-linear-48b 4096 and 32768 (``--quick``: the
smaller of each preset), 64-token pages, bf16 KV, fp32 KDA state, cp 1. Block tables:
``contiguous`` (both sides' blocks in one run, as a fresh pool hands them out) and ``fragmented``
(the ctx's blocks a seeded permutation of its pool). On the CPU the "issue" column is the
reference unit-by-unit copy (a memcpy of the whole shard), not a launch.

    python bench/pull_launch.py --quick --out pull_launch.json [--device cuda]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from _common import base_parser, machine_info, markdown_table, write_json  # noqa: E402

TPB = 64
SHAPES = [("kimi-k3-mid", 512), ("kimi-k3-mid", 4096), ("kimi-linear-48b", 4096), ("kimi-linear-48b", 32768)]
QUICK_SHAPES = [("kimi-k3-mid", 512), ("kimi-linear-48b", 4096)]
PATTERNS = ("contiguous", "fragmented")
MESSAGE_BYTES = 16 << 20  # TransceiverConfig.message_bytes' default
PHASES = ("receiver plan", "unit groups", "copy issue")
EVICT_BYTES = 64 << 20  # read before each cold repetition: more than any CPU cache here


def _evict(junk) -> None:  # noqa: ANN001 (a numpy array)
    """Read `junk` (evicts the CPU caches), then other Python work (another request's steps)."""
    import json

    junk.sum()
    for i in range(2000):
        json.dumps({"request": i, "tokens": [i] * 5})


def _gpu_us(fn) -> float:  # noqa: ANN001
    """GPU time of `fn`'s kernels (CUDA events; launched behind a 1 ms sleep, so not host-bound)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def bench_shape(preset: str, num_tokens: int, device: str, reps: int, warmup: int) -> list[dict]:
    import numpy as np
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.kernels.copy.units import UnitCopier, UnitGroup
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import ShardPlan, ShardSpec, layout_for
    from helixserve.transceiver.gen.pull import pull_pair

    cfg = get_preset(preset)
    layout = layout_for(cfg, torch.bfloat16, TPB, preset)
    spec = ShardSpec(layout, num_tokens)
    n = len(spec.blocks)
    num_blocks = 2 * n + 2
    gen, ctx = (allocate_model_caches(cache_spec_for(cfg, torch.bfloat16, TPB), num_blocks, 2, device=device)
                for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spec_bytes = sum(seg.nbytes for seg in ShardPlan.for_receiver(spec, gen, list(range(n)), 0, MESSAGE_BYTES).segments
                     if seg.kind.name != "AUX")
    src, dst = (torch.ones(spec_bytes, dtype=torch.uint8, device=device) for _ in range(2))  # the floor's pair
    floor = UnitCopier([src], [dst], [np.zeros((1, 2), dtype=np.int64)])
    one = [UnitGroup(spec_bytes, floor.segments[0], np.zeros((1, 2), dtype=np.int64))]
    junk = np.ones(EVICT_BYTES, dtype=np.uint8)
    pairs: dict = {}  # RemotePools.pairs: the pair is built on a pool set's first pull, then kept
    pull_pair(pairs, layout, ctx, gen, spec.num_local_heads)
    records = []
    for pattern in PATTERNS:
        gen_blocks = list(range(n))
        ctx_blocks = (list(range(n, 2 * n)) if pattern == "contiguous"
                      else np.random.default_rng(num_tokens).permutation(num_blocks)[:n].tolist())
        times: dict[str, list[float]] = {k: [] for k in (*PHASES, "floor", "cold planning")}

        def plan():  # noqa: ANN202 (what Inbound.__init__ and PullTransport.launch run before the copy)
            ShardPlan.for_receiver(spec, gen, gen_blocks, 0, MESSAGE_BYTES)
            pair = pull_pair(pairs, layout, ctx, gen, spec.num_local_heads)
            return pair, pair.groups(spec, ctx_blocks, 1, gen_blocks, 0)

        for rep in range(warmup + reps):  # the planning phases back to back, as one pull runs them
            sync()
            t0 = time.perf_counter()
            ShardPlan.for_receiver(spec, gen, gen_blocks, 0, MESSAGE_BYTES)
            t1 = time.perf_counter()
            pair = pull_pair(pairs, layout, ctx, gen, spec.num_local_heads)
            groups = pair.groups(spec, ctx_blocks, 1, gen_blocks, 0)
            t2 = time.perf_counter()
            if rep >= warmup:
                for key, dt in zip(PHASES[:2], (t1 - t0, t2 - t1)):
                    times[key].append(dt * 1e6)
        assert sum(g.nbytes for g in groups) == spec_bytes
        for rep in range(warmup + reps):  # the same planning, cold
            _evict(junk)
            t0 = time.perf_counter()
            pair, groups = plan()
            if rep >= warmup:
                times["cold planning"].append((time.perf_counter() - t0) * 1e6)
        # then the issue, taking turns with the floor (apart: a CPU run's reference copy, a memcpy
        # of the shard, would flush the caches the next plan reads, which no GPU launch does)
        for rep in range(warmup + reps):
            for key, issue in (("copy issue", lambda: pair.copier.copy(groups)), ("floor", lambda: floor.copy(one))):
                sync()
                start = time.perf_counter()
                issue()
                elapsed = time.perf_counter() - start
                sync()
                if rep >= warmup:
                    times[key].append(elapsed * 1e6)
        if device == "cuda":  # the copy's GPU time next to one copy_ of the same bytes (queued behind a sleep)
            for key, fn in (("kernel gpu", lambda: pair.copier.copy(groups)), ("copy_ gpu", lambda: dst.copy_(src))):
                times[key] = [_gpu_us(fn) for _ in range(warmup + reps)][warmup:]
        med = {k: statistics.median(v) for k, v in times.items()}
        med["total"] = sum(med[p] for p in PHASES)
        med["hot planning"] = sum(med[p] for p in PHASES[:2])
        units = sum(len(g.segments) * len(g.units) for g in groups)
        records.append({"preset": preset, "tokens": num_tokens, "pattern": pattern, "bytes": spec_bytes,
                        "mib": spec_bytes / 2**20, "groups": len(groups), "units": units, "median_us": med,
                        "times_us": times})
        print(f"  {preset} {num_tokens} {pattern}: total {med['total']:.0f} us, floor {med['floor']:.0f} us",
              flush=True)
    return records


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per shape (after warm-up)")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    reps = args.reps or (5 if args.quick else 21)
    records = []
    for preset, num_tokens in shapes:
        records += bench_shape(preset, num_tokens, args.device, reps, warmup=2)
    headers = ["preset", "prompt tokens", "blocks", "MiB", "units", *(f"{p} µs" for p in PHASES), "total µs",
               "floor µs (1 unit)", "planning hot µs", "planning cold µs"]
    rows = [[r["preset"], r["tokens"], r["pattern"], r["mib"], r["units"],
             *(r["median_us"][p] for p in PHASES), r["median_us"]["total"], r["median_us"]["floor"],
             r["median_us"]["hot planning"], r["median_us"]["cold planning"]]
            for r in records]
    if args.device == "cuda":
        headers += ["copy GPU µs", "copy_ GPU µs (same bytes)", "copy_ / copy"]
        for row, r in zip(rows, records):
            gpu, ref = r["median_us"]["kernel gpu"], r["median_us"]["copy_ gpu"]
            row += [gpu, ref, ref / gpu]
    print(f"\nhost time to plan and issue one pulled shard's copy ({args.device}, {TPB}-token pages, median of "
          f"{reps})\n")
    print(markdown_table(headers, rows))
    write_json(args.out, {"bench": "pull_launch", "device": args.device, "tokens_per_block": TPB, "reps": reps,
                          "machine": machine_info(), "results": records})


if __name__ == "__main__":
    main()
