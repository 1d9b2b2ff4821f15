"""Cache-aware routing: a multi-turn chat workload through the router, over 2 ctx workers routed
round-robin and cache-aware, against 1 ctx worker (every prefix on the one cache: the ideal hit
rate), prefix caching on everywhere, one run.

Each setup is one ``helixserve launch`` of deploy/configs/local.yaml (free ports; 1 or 2 ctx
workers, the dp 1 x cp 2 gen world over UCX; the tiny K3 checkpoint on CPU unless ``--model``).
Workload: ``--conversations`` chats run at once, each ``--turns`` turns in order; every chat
starts from one shared system prompt of ``--system-chars`` characters; a turn sends the whole
conversation so far plus a new user message (streamed, greedy) and the reply joins the
conversation. Per setup: the ctx workers' prefix-cache hit rate (prompt tokens found cached /
looked up, from their ``/metrics``), prefill tokens computed, TTFT p50 / p90 at the router, and
the hit rate as a fraction of the 1-worker run's.

    python bench/prefix_routing.py [--quick] [--out FILE] [--model DIR]
    python bench/prefix_routing.py --device cuda --load-format dummy --model kimi-k3-mid

``--device cuda`` starts deploy/configs/gpu1.yaml (every worker on one GPU; the 2 ctx workers and
the gen world share it) unless ``--config``; ``--load-format dummy`` takes a preset name for
``--model`` (random weights at its shapes, no checkpoint on disk).
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, sse_events, write_json  # noqa: E402
from serve import GPU_CONFIG, MODEL, REPO, Servers, _pct  # noqa: E402

SETUPS = [("1 ctx (ideal)", 1, "round_robin"), ("2 ctx round_robin", 2, "round_robin"),
          ("2 ctx cache_aware", 2, "cache_aware")]


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _cache_counters(servers: Servers) -> tuple[float, float]:
    """(prompt tokens looked up, found cached), summed over the ctx workers."""
    queries = sum(_counter(u, "helixserve_worker_prefix_cache_queries_total") for u in servers.ctx_urls)
    hits = sum(_counter(u, "helixserve_worker_prefix_cache_hits_total") for u in servers.ctx_urls)
    return queries, hits


async def _turn(client, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:  # noqa: ANN001
    """One streamed chat request: (TTFT, reply text)."""
    began, ttft, parts = time.perf_counter(), None, []
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for event in sse_events(response, url):
            content = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - began
                parts.append(content)
    return (ttft if ttft is not None else time.perf_counter() - began), "".join(parts)


async def _workload(url: str, shape: dict, timeout_s: float) -> list[float]:
    import httpx

    rng = random.Random(0)
    system = "".join(rng.choice("abcdefghij klmnop") for _ in range(shape["system_chars"]))
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def chat(c: int) -> list[float]:
            messages, ttfts = [{"role": "system", "content": system}], []
            for t in range(shape["turns"]):
                messages.append({"role": "user", "content": f"conversation {c}, question {t}: " + "why " * 8})
                ttft, reply = await _turn(client, url, messages, shape["max_tokens"])
                messages.append({"role": "assistant", "content": reply})
                ttfts.append(ttft)
            return ttfts

        runs = await asyncio.wait_for(asyncio.gather(*(chat(c) for c in range(shape["conversations"]))), timeout_s)
    return [t for run in runs for t in run]


def run_setup(args, name: str, num_ctx: int, policy: str, shape: dict) -> dict:  # noqa: ANN001
    overrides = {"cache": {"prefix_caching": True}, "router": {"policy": policy}}
    config = args.config or (GPU_CONFIG if args.device == "cuda" else REPO / "deploy" / "configs" / "local.yaml")
    servers = Servers(Path(args.model), Path(args.log), config, args.load_format, num_ctx=num_ctx,
                      overrides=overrides)
    try:
        servers.start(args.ready_timeout)
        before = _cache_counters(servers)
        ttfts = asyncio.run(_workload(servers.router_url, shape, args.timeout))
        queries, hits = (a - b for a, b in zip(_cache_counters(servers), before, strict=True))
    finally:
        servers.stop()
    return {"setup": name, "ctx_workers": num_ctx, "policy": policy, "requests": len(ttfts),
            "prompt_tokens": queries, "cached_tokens": hits, "prefill_tokens": queries - hits,
            "hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_ms": 1e3 * _pct(ttfts, 50), "ttft_p90_ms": 1e3 * _pct(ttfts, 90)}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "checkpoints" / MODEL),
                        help="checkpoint directory (a missing kimi-k3-tiny one is made)")
    parser.add_argument("--config", type=Path, default=None, help="deployment YAML (default: by --device)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"cuda: {GPU_CONFIG.relative_to(REPO)} (every worker on one GPU) unless --config")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: --model names a preset (random weights, no checkpoint)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--system-chars", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one setup's workload may take")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench-prefix-routing.log"))
    args = parser.parse_args()
    shape = {"conversations": args.conversations or (4 if args.quick else 16),
             "turns": args.turns or (4 if args.quick else 8),
             "system_chars": args.system_chars or (512 if args.quick else 2000), "max_tokens": args.max_tokens}
    rows = [run_setup(args, name, n, policy, shape) for name, n, policy in SETUPS]
    ideal = rows[0]["hit_rate"] or 1.0
    for row in rows:
        row["of_ideal"] = row["hit_rate"] / ideal
    headers = ["setup", "requests", "prompt tok", "prefill tok", "hit rate", "of ideal", "TTFT p50 ms", "p90"]
    print(markdown_table(headers, [[r["setup"], r["requests"], r["prompt_tokens"], r["prefill_tokens"],
                                    r["hit_rate"], r["of_ideal"], r["ttft_p50_ms"], r["ttft_p90_ms"]] for r in rows]))
    write_json(args.out, {"machine": machine_info(), "model": args.model, "device": args.device,
                          "load_format": args.load_format, "shape": shape, "rows": rows})


if __name__ == "__main__":
    main()
