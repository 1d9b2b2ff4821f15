"""Serving latency and throughput: disaggregated (router -> ctx -> UCX -> gen world) vs aggregated
(the same gen world alone), over a concurrency sweep, in one run.

One deployment is started with ``helixserve launch`` from deploy/configs/local.yaml (free ports):
one ctx worker and one gen world of dp 1 x cp 2 receiving the KV over UCX, the tiny K3 checkpoint
on CPU unless ``--model`` says otherwise. For each concurrency level, the same synthetic requests
(random prompt token ids, greedy, ``ignore_eos``, streamed) go ``disagg``: to the router, and
``agg``: straight to the gen worker without ``disaggregated_params`` (it prefills and decodes).
Per mode and level: TTFT and inter-token latency (ITL: gaps between streamed content chunks; a
chunk can carry several tokens while the detokenizer holds back partial characters) p50 / p90 /
p99, time per output token after the first (TPOT, per request) p50 / p90, output tokens/s and
requests/s; for ``disagg`` also the KV transfer seen by the gen worker (admission to the first
output: both CP ranks received their shard over UCX, agreed, and ran one step; mean ms per request)
and the KV bytes moved per request (both shards).

``--repeats N`` runs each level N times, the two modes alternating (disagg, agg, disagg, ...), and
adds a ratios table: per level, the median over rounds of each round's disagg / agg tok/s (with
the range), the modes' median TTFT p50 and in how many rounds disagg met TTFT <= (agg TTFT + KV
transfer) x 1.05. On a shared GPU the aggregated figures move between runs by about as much as
the gap, so one pair of runs says little about a 0.9x target.

``--modes agg`` starts one single-process gen worker alone (``serve-gen``, kv_source recompute)
and measures only ``agg``: a model of which one copy fits the device, e.g. Kimi-Linear-48B's
dummy weights on one H200 (``--load-format dummy --model kimi-linear-48b``: no checkpoint on disk).

    python bench/serve.py --quick --out bench/results/serve_quick.json
    python bench/serve.py --device cuda --modes agg --load-format dummy --model kimi-linear-48b
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, median, sse_events, write_json  # noqa: E402

from helixserve.config import INTERNAL_SECRET_ENV  # noqa: E402
from helixserve.testing.servers import SECRET_HEADER, free_ports, new_secret, secret_for, trust_workers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "kimi-k3-tiny"
GPU_CONFIG = REPO / "deploy" / "configs" / "gpu1.yaml"


def _get(url: str) -> dict:
    """GET a JSON page; a worker's is asked with its deployment's internal secret."""
    secret = secret_for(url)
    request = urllib.request.Request(url, headers={SECRET_HEADER: secret} if secret else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


class Servers:
    """``helixserve launch`` on a copy of `config` (deploy/configs/local.yaml) with free ports;
    ``num_ctx``: that many ctx workers like the first; ``overrides``: sections' keys changed."""

    def __init__(self, model: Path, log: Path, config: Path = REPO / "deploy" / "configs" / "local.yaml",
                 load_format: str = "auto", agg_only: bool = False, num_ctx: int = 1,
                 overrides: dict[str, dict] | None = None) -> None:
        from helixserve.config import DeploymentConfig

        router, ctx, gen, tx, *extra = free_ports(4 + 2 * (num_ctx - 1))
        base = DeploymentConfig.from_yaml(config).model_dump(mode="json")
        base["model"]["path"] = str(model)
        base["model"]["served_name"] = MODEL
        base["model"]["load_format"] = load_format
        self.agg_only = agg_only
        if agg_only:  # one single-process gen worker that prefills and decodes: no ctx, no router
            base["gen"][0].update(kv_source="recompute", dp=1, cp=1)
        base["ctx"][0].update(port=ctx, transceiver_port=tx)
        base["ctx"][1:] = [{**base["ctx"][0], "port": extra[2 * i], "transceiver_port": extra[2 * i + 1]}
                           for i in range(num_ctx - 1)]
        base["gen"][0].update(port=gen)
        base["router"].update(port=router, health_check_interval_s=0.25)
        for section, values in (overrides or {}).items():
            base[section].update(values)
        self.config = DeploymentConfig.model_validate(base)
        self.router_url, self.ctx_url, self.gen_url = (f"http://127.0.0.1:{p}" for p in (router, ctx, gen))
        self.ctx_urls = [w.url for w in self.config.ctx]
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
        self.config_file = Path(self._tmp.name) / "deployment.yaml"
        self.config.to_yaml(self.config_file)
        self.secret = new_secret()  # launch uses it (env) instead of making one: gen is asked directly too
        trust_workers([*self.ctx_urls, self.gen_url], self.secret)
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        command = ["serve-gen", "--index", "0"] if self.agg_only else ["launch"]
        self.process = subprocess.Popen([sys.executable, "-m", "helixserve.cli", *command, "-c", str(self.config_file)],
                                        cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, INTERNAL_SECRET_ENV: self.secret})
        ready_url = f"{self.gen_url if self.agg_only else self.router_url}/ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"helixserve {command[0]} exited with {self.process.returncode}; see {self._log.name}")
            try:
                if _get(ready_url).get("ready", True):  # a worker answers 200 when ready, the router {"ready": ...}
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"not ready within {timeout_s:.0f} s; see {self._log.name}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()
        self._tmp.cleanup()


async def _one(client, url: str, body: dict) -> dict:  # noqa: ANN001 (httpx.AsyncClient)
    began = time.perf_counter()
    chunk_times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for event in sse_events(response, url):
            if "error" in event:
                raise RuntimeError(f"{url}: stream error {event['error']}")
            if event.get("choices") and event["choices"][0].get("text"):
                chunk_times.append(time.perf_counter())
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = (chunk_times[0] if chunk_times else end) - began
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (end - began - ttft) / (num_tokens - 1) if num_tokens > 1 else None
    return {"ttft": ttft, "gaps": gaps, "tpot": tpot, "tokens": num_tokens, "seconds": end - began}


async def _level(url: str, bodies: list[dict], concurrency: int, timeout_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4)
    secret = secret_for(url)
    headers = {SECRET_HEADER: secret} if secret else {}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        gate = asyncio.Semaphore(concurrency)

        async def gated(body: dict) -> dict:
            async with gate:
                return await _one(client, url, body)

        began = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(gated(b) for b in bodies)), timeout_s)
        wall = time.perf_counter() - began
    return {"results": results, "wall": wall}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _summary(mode: str, concurrency: int, run: dict, kv: dict | None) -> dict:
    results = run["results"]
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    row = {"mode": mode, "concurrency": concurrency, "requests": len(results),
           **{f"ttft_p{q}_ms": 1e3 * _pct(ttfts, q) for q in (50, 90, 99)},
           **{f"itl_p{q}_ms": (1e3 * v if (v := _pct(gaps, q)) is not None else None) for q in (50, 90, 99)},
           **{f"tpot_p{q}_ms": (1e3 * v if (v := _pct(tpots, q)) is not None else None) for q in (50, 90)},
           "output_tok_s": tokens / run["wall"], "req_s": len(results) / run["wall"], "wall_s": run["wall"]}
    if kv is not None:
        row.update(kv)
    return row


def _kv_counters(servers: Servers) -> tuple[float, float, float]:
    stats = _get(f"{servers.gen_url}/stats")
    return stats["kv_transfers_completed"], stats["kv_transfer_seconds"], stats["kv_transfer_bytes"]


def _bodies(rng: random.Random, n: int, prompt_len: int, max_tokens: int, vocab: int) -> list[dict]:
    return [{"model": MODEL, "prompt": [rng.randrange(1, vocab) for _ in range(prompt_len)],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}} for _ in range(n)]


def run(args) -> dict:  # noqa: ANN001 (argparse namespace)
    levels = args.concurrency or ([1, 4, 16] if args.quick else [1, 4, 16, 32])
    prompt_len = args.prompt_len or (48 if args.quick else 200)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    config = args.config or (GPU_CONFIG if args.device == "cuda" else REPO / "deploy" / "configs" / "local.yaml")
    agg_only = args.modes == "agg"
    servers = Servers(Path(args.model), Path(args.log), config, args.load_format, agg_only)
    rng = random.Random(0)
    rows = []
    try:
        servers.start(args.ready_timeout)
        vocab = min(1000, _vocab(servers))
        for url in (servers.gen_url,) if agg_only else (servers.router_url, servers.gen_url):  # warm-up, unrecorded
            asyncio.run(_level(url, _bodies(rng, 2, prompt_len, max_tokens, vocab), 2, args.timeout))
        for concurrency in levels:
            n = max(args.min_requests, (args.rounds or (2 if args.quick else 4)) * concurrency)
            for round_ in range(args.repeats):
                bodies = _bodies(rng, n, prompt_len, max_tokens, vocab)
                if agg_only:
                    agg = asyncio.run(_level(servers.gen_url, bodies, concurrency, args.timeout))
                    rows.append({**_summary("agg", concurrency, agg, None), "round": round_})
                    print(f"concurrency {concurrency}: agg {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
                    continue
                before = _kv_counters(servers)
                disagg = asyncio.run(_level(servers.router_url, bodies, concurrency, args.timeout))
                after = _kv_counters(servers)
                moved = max(1.0, after[0] - before[0])
                kv = {"kv_transfer_ms": 1e3 * (after[1] - before[1]) / moved,
                      "kv_mb_per_request": (after[2] - before[2]) / moved / 1e6}
                rows.append({**_summary("disagg", concurrency, disagg, kv), "round": round_})
                agg = asyncio.run(_level(servers.gen_url, bodies, concurrency, args.timeout))
                rows.append({**_summary("agg", concurrency, agg, None), "round": round_})
                print(f"concurrency {concurrency}: disagg {rows[-2]['output_tok_s']:.1f} tok/s, "
                      f"agg {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        servers.stop()
    return {"machine": machine_info(), "model": str(args.model), "load_format": args.load_format, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "config": str(config), "deployment": _deployment(servers.config),
            "repeats": args.repeats, "rows": rows, "ratios": ratios(rows)}


def _deployment(config) -> str:  # noqa: ANN001 (a DeploymentConfig)
    gen = config.gen[0]
    if gen.kv_source == "recompute" and gen.world_size == 1:
        return f"1 single-process gen worker ({gen.device or config.model.device}), {config.model.dtype}"
    return (f"1 ctx ({config.ctx[0].device or config.model.device}) + gen world dp {gen.dp} x cp {gen.cp} "
            f"({gen.device or config.model.device}, kv_source {gen.kv_source}), {config.model.dtype}")


def _vocab(servers: Servers) -> int:
    from helixserve.models.dummy import model_config_of  # a checkpoint's config.json, or a preset's (dummy)

    return model_config_of(servers.config.model.path, servers.config.model.load_format).vocab_size


HEADERS = ["mode", "conc", "reqs", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99", "TPOT p50", "p90",
           "tok/s", "req/s", "KV ms/req", "KV MB/req"]
KEYS = ["mode", "concurrency", "requests", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
        "itl_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "output_tok_s", "req_s", "kv_transfer_ms", "kv_mb_per_request"]


def table(rows: list[dict]) -> str:
    return markdown_table(HEADERS, [[r.get(k) for k in KEYS] for r in rows])


def ratios(rows: list[dict]) -> list[dict]:
    """Per level, over its rounds: disagg / agg tok/s (median, min, max), the modes' median TTFT
    p50 and KV ms, and the rounds whose disagg TTFT p50 met (agg TTFT p50 + KV ms) x 1.05."""
    out = []
    for concurrency in sorted({r["concurrency"] for r in rows}):
        pairs = {}
        for r in rows:
            if r["concurrency"] == concurrency:
                pairs.setdefault(r.get("round", 0), {})[r["mode"]] = r
        pairs = [p for p in pairs.values() if "disagg" in p and "agg" in p]
        if not pairs:
            continue
        tok = [p["disagg"]["output_tok_s"] / p["agg"]["output_tok_s"] for p in pairs]
        met = sum(p["disagg"]["ttft_p50_ms"] <= 1.05 * (p["agg"]["ttft_p50_ms"] + p["disagg"]["kv_transfer_ms"])
                  for p in pairs)
        out.append({"concurrency": concurrency, "rounds": len(pairs), "tok_s_ratio": median(tok),
                    "tok_s_ratio_min": min(tok), "tok_s_ratio_max": max(tok),
                    "disagg_ttft_p50_ms": median([p["disagg"]["ttft_p50_ms"] for p in pairs]),
                    "agg_ttft_p50_ms": median([p["agg"]["ttft_p50_ms"] for p in pairs]),
                    "kv_transfer_ms": median([p["disagg"]["kv_transfer_ms"] for p in pairs]),
                    "ttft_bound_met": f"{met}/{len(pairs)}"})
    return out


RATIO_HEADERS = ["conc", "rounds", "tok/s disagg/agg (median)", "min", "max", "TTFT p50 disagg", "agg",
                 "KV ms", "TTFT bound met"]
RATIO_KEYS = ["concurrency", "rounds", "tok_s_ratio", "tok_s_ratio_min", "tok_s_ratio_max", "disagg_ttft_p50_ms",
              "agg_ttft_p50_ms", "kv_transfer_ms", "ttft_bound_met"]


def ratio_table(summary: list[dict]) -> str:
    return markdown_table(RATIO_HEADERS, [[r.get(k) for k in RATIO_KEYS] for r in summary])


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for mode in ("disagg", "agg"):
        mine = [r for r in rows if r["mode"] == mode]
        x = sorted({r["concurrency"] for r in mine})
        for ax, key, label in zip(axes, ("ttft_p50_ms", "itl_p50_ms", "output_tok_s"),
                                  ("TTFT p50 (ms)", "ITL p50 (ms)", "output tokens/s")):
            y = [median([r[key] for r in mine if r["concurrency"] == c and r[key] is not None] or [float("nan")])
                 for c in x]  # the median over rounds
            ax.plot(x, y, marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "checkpoints" / MODEL),
                        help="checkpoint directory (a missing kimi-k3-tiny one is made)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one level may take")
    parser.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench-serve.log"),
                        help="where the servers' output goes")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot (needs matplotlib)")
    parser.add_argument("--config", type=Path, default=None, help="deployment YAML (default deploy/configs/local.yaml)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"cuda: {GPU_CONFIG.relative_to(REPO)} (ctx and gen sharing one GPU) unless --config")
    parser.add_argument("--rounds", type=int, default=None, help="requests per level = rounds x concurrency")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per level, the two modes alternating (see the ratios table)")
    parser.add_argument("--modes", choices=("both", "agg"), default="both",
                        help="agg: one single-process gen worker alone (a model whose one copy fits the GPU)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights at the real shapes; --model may name a preset")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds the servers may take to be ready")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="at least this many requests per level (a steadier p50 at low concurrency)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    payload = run(args)
    print(f"\n{payload['deployment']}; prompt {payload['prompt_len']} tokens, "
          f"{payload['max_tokens']} generated (times in ms)\n")
    print(table(payload["rows"]))
    print(f"\nratios over {payload['repeats']} round(s) per level\n")
    print(ratio_table(payload["ratios"]))
    write_json(args.out, payload)
    if args.plot is not None:
        plot(payload["rows"], args.plot)


if __name__ == "__main__":
    main()
