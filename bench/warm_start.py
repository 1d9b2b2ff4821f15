"""Warm start: the first request's TTFT after the router's ``/ready`` vs steady state, with the
workers' warm-up off and on (``ctx[*].warm_up`` / ``gen[*].warm_up``), each in a fresh deployment.

The deployment is bench/serve.py's (``helixserve launch`` on deploy/configs/local.yaml with free
ports: one ctx worker, a gen world of dp 1 x cp 2 over UCX; ``--config`` for another, e.g.
deploy/configs/gpu1.yaml on a GPU). Per mode: seconds from start to ``/ready``, the first
request's TTFT (streamed, greedy; ``--target router``: disaggregated, ctx -> UCX -> gen; ``gen``:
straight to the gen worker, aggregated), then ``--steady`` more requests of the same shape one
after another: their TTFT p50, and first / p50. ``--repeats``: fresh deployments per mode, the
modes taking turns (load from other processes falls on both alike); the summary has the medians.

    python bench/warm_start.py --quick --out bench/figures/warm_start_cpu.json
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, write_json  # noqa: E402
from serve import MODEL, REPO, Servers, _bodies, _level, _pct, _vocab  # noqa: E402


def _one_mode(args, is_warm_up: bool) -> dict:  # noqa: ANN001 (argparse namespace)
    from helixserve.config import DeploymentConfig

    servers = Servers(Path(args.model), Path(args.log), args.config or REPO / "deploy" / "configs" / "local.yaml")
    data = servers.config.model_dump(mode="json")
    for role in ("ctx", "gen"):
        for worker in data[role]:
            worker["warm_up"] = is_warm_up
    servers.config = DeploymentConfig.model_validate(data)
    servers.config.to_yaml(servers.config_file)
    rng = random.Random(0)
    began = time.perf_counter()
    try:
        servers.start()
        ready_s = time.perf_counter() - began
        vocab = min(1000, _vocab(servers))
        bodies = _bodies(rng, 1 + args.steady, args.prompt_len, args.max_tokens, vocab)
        url = servers.router_url if args.target == "router" else servers.gen_url
        ttfts = [asyncio.run(_level(url, [b], 1, args.timeout))["results"][0]["ttft"] for b in bodies]
    finally:
        servers.stop()
    steady = _pct(ttfts[1:], 50)
    return {"warm_up": is_warm_up, "ready_s": ready_s, "first_ttft_ms": 1e3 * ttfts[0],
            "steady_ttft_p50_ms": 1e3 * steady, "first_over_steady": ttfts[0] / steady,
            "ttfts_ms": [1e3 * t for t in ttfts]}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "checkpoints" / MODEL),
                        help="checkpoint directory (a missing kimi-k3-tiny one is made)")
    parser.add_argument("--config", type=Path, default=None,
                        help="deployment YAML (default: deploy/configs/local.yaml); ports are replaced")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--steady", type=int, default=None, help="requests after the first")
    parser.add_argument("--repeats", type=int, default=1, help="fresh deployments per mode")
    parser.add_argument("--target", choices=["router", "gen"], default="router")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--log", default="/tmp/bench-warm-start.log", help="where the servers' output goes")
    args = parser.parse_args()
    args.prompt_len = args.prompt_len or (48 if args.quick else 200)
    args.max_tokens = args.max_tokens or (8 if args.quick else 32)
    args.steady = args.steady or (5 if args.quick else 10)
    rows = []
    for _ in range(args.repeats):
        for is_warm_up in (False, True):  # alternate: machine load falls on both alike
            rows.append(_one_mode(args, is_warm_up))
            print(f"warm_up {is_warm_up}: ready in {rows[-1]['ready_s']:.1f} s, first TTFT "
                  f"{rows[-1]['first_ttft_ms']:.0f} ms, steady p50 {rows[-1]['steady_ttft_p50_ms']:.0f} ms",
                  flush=True)
    keys = ["ready_s", "first_ttft_ms", "steady_ttft_p50_ms", "first_over_steady"]
    summary = [{"warm_up": mode, "runs": len(mine), **{k: statistics.median(r[k] for r in mine) for k in keys}}
               for mode in (False, True) for mine in [[r for r in rows if r["warm_up"] is mode]]]
    print(f"\nmedians over {args.repeats} deployment(s) per mode, target {args.target}\n")
    print(markdown_table(["warm_up", "runs", "ready s", "first TTFT ms", "steady TTFT p50 ms", "first / steady"],
                         [[r["warm_up"], r["runs"], *(r[k] for k in keys)] for r in summary]))
    write_json(args.out, {"machine": machine_info(), "model": str(args.model), "target": args.target,
                          "config": str(args.config or "deploy/configs/local.yaml"),
                          "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "summary": summary,
                          "rows": rows})


if __name__ == "__main__":
    main()
