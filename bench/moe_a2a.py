"""MoE all-to-all per layer: host-split (split sizes read on the host) vs padded (static capacity).

A world (gloo on CPU, default 2 ranks; ``--device cuda``: NCCL, one GPU per rank) runs one MoE
layer's dispatch + combine with random top-k routing; the expert is the routing weight times the row (``y = w * x``), so the time is the
all-to-all path itself. ``padded`` uses ``capacity = rows per rank`` (exact: never overflows).
The two paths alternate per repetition; a call's time is the slowest rank's, median over
repetitions. ``ratio = padded / host``. ``slots / assignments`` is the padded path's extra expert
work (it runs experts over every slot, masked ones included).

On CPU the padded path only saves the split-size exchange; its real win is on GPU, where the
host-split path syncs the host once per MoE layer and cannot be captured in a CUDA graph: with
``--device cuda`` a third row, ``padded_graph``, replays the padded layer from a CUDA graph
(``graph/host`` in the table).

    python bench/moe_a2a.py [--quick] [--out FILE] [--world 2] [--rows 8,64,256] [--hidden 2048]
        [--device cpu|cuda]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, machine_info, markdown_table, median, write_json  # noqa: E402

from helixserve.launch.processes import run_local_world  # noqa: E402
from helixserve.parallel import Mapping, init_parallel, moe_a2a, moe_dispatch_padded  # noqa: E402


def _graph(fn: Any) -> Any:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _rank(rank: int, world_size: int, init_method: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    cuda = opts["device"] == "cuda"
    groups = init_parallel(Mapping(world_size, rank, cp=world_size), init_method,
                           backend="nccl" if cuda else "gloo", local_rank=rank, timeout_s=300)
    dev, dtype = groups.device, torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    experts, top_k = opts["experts"], opts["top_k"]
    rows_out = []
    try:
        for num_rows in opts["rows"]:
            gen = torch.Generator().manual_seed(rank * 7919 + num_rows)
            x = torch.randn(num_rows, opts["hidden"], generator=gen).to(dev, dtype)
            weights, ids = torch.randn(num_rows, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
            weights, ids = weights.to(dev), ids.to(dev)
            fn = lambda xr, local_ids, w: xr * w[:, None].to(xr.dtype)  # noqa: E731
            calls = {
                "host": lambda: moe_a2a(x, ids, weights, fn, num_experts=experts, group=groups.ep),
                "padded": lambda: moe_a2a(x, ids, weights, fn, num_experts=experts, group=groups.ep, capacity=num_rows),
            }
            if cuda:
                calls["padded_graph"] = _graph(calls["padded"])
            times: dict[str, list[float]] = {name: [] for name in calls}
            for rep in range(opts["warmup"] + opts["reps"]):
                for name, call in calls.items():
                    torch.distributed.barrier(groups.cpu)
                    start = time.perf_counter()
                    call()
                    sync()
                    if rep >= opts["warmup"]:
                        times[name].append(time.perf_counter() - start)
            padded = moe_dispatch_padded(x, ids, weights, experts, groups.ep, capacity=num_rows)
            rows_out.append({"rows": num_rows, "times": times, "slots": padded.x.shape[0],
                             "assignments": int(padded.valid.sum())})
        return rows_out
    finally:
        groups.destroy()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rows", default=None, help="comma-separated rows per rank (default 8,64,256; quick 8,64)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    opts = {"rows": [int(r) for r in (args.rows or ("8,64" if args.quick else "8,64,256")).split(",")],
            "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
            "device": args.device, "warmup": 3 if args.quick else 10, "reps": 10 if args.quick else 50}
    per_rank = run_local_world(_rank, args.world, opts, timeout_s=1800)
    table, results = [], []
    for i, num_rows in enumerate(opts["rows"]):
        names = list(per_rank[0][i]["times"])
        step = {name: median([max(r[i]["times"][name][k] for r in per_rank) for k in range(opts["reps"])])
                for name in names}
        slots = sum(r[i]["slots"] for r in per_rank)
        assignments = sum(r[i]["assignments"] for r in per_rank)
        ratio = step["padded"] / step["host"]
        graph = step.get("padded_graph")
        results.append({"metric": f"moe_a2a_rows{num_rows}", "host_ms": step["host"] * 1e3,
                        "padded_ms": step["padded"] * 1e3, "ratio": ratio, "slots": slots, "assignments": assignments,
                        **({"padded_graph_ms": graph * 1e3, "graph_ratio": graph / step["host"]} if graph else {})})
        table.append([num_rows, step["host"] * 1e3, step["padded"] * 1e3, ratio,
                      graph * 1e3 if graph else None, graph / step["host"] if graph else None, slots / max(assignments, 1)])
    backend = "NCCL, CUDA" if args.device == "cuda" else "gloo, CPU"
    print(f"world={args.world} ({backend}) hidden={args.hidden} experts={args.experts} top_k={args.top_k}; "
          f"ms per MoE layer (dispatch + combine), slowest rank, median of {opts['reps']}")
    print(markdown_table(["rows/rank", "host-split ms", "padded ms", "padded/host", "graph ms", "graph/host",
                          "slots/assignments"], table))
    write_json(args.out, {"bench": "moe_a2a", "machine": machine_info(), "options": opts, "results": results})


if __name__ == "__main__":
    main()
