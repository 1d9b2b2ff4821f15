"""Soak: N concurrent clients for M minutes against ``helixserve launch``, with a ctx worker kill
and a gen world rank kill in the middle; requests by status, latency, RSS growth, blocks left.

One deployment is started with ``helixserve launch`` from deploy/configs/local.yaml (free ports;
launch's restart policy and the gen worker's world restarts at their defaults): one ctx worker
and one gen world of dp 1 x cp 2 receiving the KV over UCX, the tiny K3 checkpoint on CPU.
Each client loops until the end: a completion or a chat request, streamed or not (the four kinds
in turn, seeded prompt and ``max_tokens``), through the router with httpx; after an error it
pauses ``--error-pause`` seconds (so an outage counts tries, not a busy loop). At 1/3 of the run
the ctx worker is killed (SIGKILL to its process group: ``launch`` starts it again), at 2/3 gen
world rank 1 (SIGKILL: the gen worker restarts its world). Reported:

- requests by kind and status (``200``; a worker's error code such as ``503 gen_world_failed``;
  ``stream <code>`` for an error event after a stream started; ``transport`` for a connection
  that failed);
- p50 / p99 latency (whole request, streamed ones to their last event) of the successful ones;
- each fault: when, and seconds until the router's ``/ready`` answered 200 again;
- RSS per process at the start (after a warm-up) and the end, and the growth (psutil when
  installed, else /proc); a process that was restarted is a new one (its pid changes);
- slowloris: ``--idle-connections`` idle and ``--slow-connections`` slow-header connections held
  on the router during the whole run (the clients above run beside them), and how many of each
  the router closed;
- refused large bodies after the run, ``--refused-bodies`` of each case in turn (413 over
  ``limits.max_body_bytes``; just under it: 404 unknown model, 400 prompt too long from the ctx,
  400 invalid JSON, 400 chat of many messages from the ctx), ``--refused-rounds`` times in the same
  deployment, with each process's RSS before and after every case and its growth (a second round
  that grows ~0 points to the allocator's high-water mark, not to something kept per request);
  ``--malloc-arena-max N`` starts the deployment with ``MALLOC_ARENA_MAX=N`` (glibc's arenas, one
  per thread that allocates, up to 8 per core by default) and ``--refused-only`` skips the clients;
- cache blocks and state slots left allocated on ctx and gen once the clients stopped (from the
  workers' ``/stats``, after at most ``--settle`` seconds; ``settled_after_s`` says how long
  freeing everything took, e.g. a prefill whose gen died is freed by its hold timeout; a hold
  whose UCX send may still read its cache stays, counted as ``ctx_quarantined``), and again once
  the refused bodies ended.

    python bench/soak.py --quick --out bench/results/soak_quick.json
    python bench/soak.py --minutes 3 --clients 32 --out bench/results/soak.json
    python bench/soak.py --refused-only --malloc-arena-max 2 --out bench/results/soak_arenas2.json
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, write_json  # noqa: E402
from serve import MODEL, REPO, Servers, _get, _pct  # noqa: E402
from _soak_hostile import refused_round, refused_table, round_growth, rss_rows, slowloris  # noqa: E402

KINDS = [("completion", False), ("completion", True), ("chat", False), ("chat", True)]
WORDS = "helix prefill decode cache block rank world router stream token latent expert".split()


# ---------------------------------------------------------------- processes


def _ppid_and_cmd(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1]), cmd


def launch_children(launcher_pid: int) -> dict[str, int]:
    """``{"ctx" | "gen rank 0" | "router": pid}`` of ``helixserve launch``'s children."""
    roles = {"serve-ctx": "ctx", "serve-gen": "gen rank 0", " router ": "router"}
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _ppid_and_cmd(int(entry.name))) and info[0] == launcher_pid:
            for needle, role in roles.items():
                if needle in info[1] + " ":
                    found[role] = int(entry.name)
    return found


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def processes(servers: Servers) -> dict[str, int]:
    """Every serving process: launch's children and the gen world's spawned ranks."""
    assert servers.process is not None
    procs = launch_children(servers.process.pid)
    try:
        ranks = _get(f"{servers.gen_url}/health")["world"]["rank_pids"][1:]
    except (OSError, KeyError, ValueError):
        ranks = []
    procs.update({f"gen rank {i}": pid for i, pid in enumerate(ranks, start=1)})
    return procs


# ---------------------------------------------------------------- clients


def _body(rng: random.Random, kind: str, stream: bool) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
    body = {"model": MODEL, "max_tokens": rng.randint(4, 24), "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": text}


def _code(payload: object) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else "?"


async def _request(client, url: str, kind: str, stream: bool, body: dict) -> str:  # noqa: ANN001
    """The request's status label (see the module docstring)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not stream:
        response = await client.post(f"{url}{path}", json=body)
        return "200" if response.status_code == 200 else f"{response.status_code} {_code(response.json())}"
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        if response.status_code != 200:
            return f"{response.status_code} {_code(json.loads(await response.aread()))}"
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "200"
            if line.startswith("data: ") and '"error"' in line:
                return f"stream {_code(json.loads(line[len('data: '):]))}"
    return "stream ended without [DONE]"


async def _client(index: int, url: str, end: float, records: list, error_pause_s: float,
                  timeout_s: float) -> None:
    import httpx

    rng = random.Random(index)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        turn = index
        while time.monotonic() < end:
            kind, stream = KINDS[turn % len(KINDS)]
            turn += 1
            began = time.monotonic()
            try:
                status = await _request(client, url, kind, stream, _body(rng, kind, stream))
            except (httpx.HTTPError, ValueError) as exc:
                status = f"transport {type(exc).__name__}"
            records.append((kind + (" stream" if stream else ""), status, time.monotonic() - began, began))
            if status != "200":
                await asyncio.sleep(error_pause_s)


# ---------------------------------------------------------------- faults


def _ready(servers: Servers) -> bool:
    try:
        return bool(_get(f"{servers.router_url}/ready").get("ready"))
    except (OSError, ValueError):
        return False


async def _fault(servers: Servers, name: str, at: float, faults: list) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    procs = processes(servers)
    target = procs.get("ctx" if name == "kill ctx" else "gen rank 1")
    if target is None:
        faults.append({"fault": name, "error": f"no process to kill among {procs}"})
        return
    killed = time.monotonic()
    if name == "kill ctx":
        os.killpg(target, signal.SIGKILL)
    else:
        os.kill(target, signal.SIGKILL)
    record = {"fault": name, "pid": target, "at_s": None, "recovered_s": None}
    faults.append(record)
    await asyncio.sleep(1.0)  # the router's health checks (0.25 s) see it first
    while time.monotonic() - killed < 120:
        if await asyncio.to_thread(_ready, servers):
            record["recovered_s"] = time.monotonic() - killed
            return
        await asyncio.sleep(0.2)


async def _soak(servers: Servers, args, began: float) -> tuple[list, list]:  # noqa: ANN001
    end = began + args.seconds
    records: list = []
    faults: list = []
    tasks = [_client(i, servers.router_url, end, records, args.error_pause, args.timeout) for i in range(args.clients)]
    tasks += [_fault(servers, "kill ctx", began + args.seconds / 3, faults),
              _fault(servers, "kill gen rank 1", began + 2 * args.seconds / 3, faults)]
    held = slowloris(servers.router_url, args.idle_connections, args.slow_connections, end)
    *_, held_result = await asyncio.gather(*tasks, held)
    for fault in faults:
        fault["at_s"] = args.seconds / 3 if fault["fault"] == "kill ctx" else 2 * args.seconds / 3
    return records, faults, held_result


# ---------------------------------------------------------------- run and report


def _left(servers: Servers, settle_s: float) -> dict:
    """What is still allocated once the clients stopped, and how long it took to reach that
    (at most ``settle_s``: a prefill whose gen never picked it up is freed after the ctx's
    ``pickup_timeout_s``)."""
    began = time.monotonic()
    deadline = began + settle_s
    while True:
        ctx, gen = _get(f"{servers.ctx_url}/stats"), _get(f"{servers.gen_url}/stats")
        left = {"ctx_used_blocks": ctx["num_used_blocks"], "ctx_used_slots": ctx["num_used_slots"],
                "ctx_held": ctx["num_held"], "ctx_pickups_held": ctx.get("pickups_held"),
                "ctx_quarantined": ctx.get("kv_pickups_quarantined"),
                "gen_used_blocks": gen["num_used_blocks"], "gen_used_slots": gen["num_used_slots"],
                "gen_live_requests": gen["num_live_requests"]}
        if not any(left.values()) or time.monotonic() > deadline:
            return {**left, "settled_after_s": time.monotonic() - began}
        time.sleep(0.5)


def _rss_now(servers: Servers) -> dict[str, tuple[int, int | None]]:
    return {name: (pid, rss_bytes(pid)) for name, pid in processes(servers).items()}


def run(args) -> dict:  # noqa: ANN001 (argparse namespace)
    args.seconds = args.seconds or (20.0 if args.quick else 60.0 * args.minutes)
    args.clients = args.clients or (6 if args.quick else 32)
    args.refused_bodies = args.refused_bodies or (2 if args.quick else 24)
    if args.malloc_arena_max:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)  # launch's processes inherit it
    servers = Servers(Path(args.model), Path(args.log))
    soak: dict = {}
    try:
        servers.start()
        if not args.refused_only:
            soak = _clients_phase(servers, args)
        rounds = [refused_round(servers.router_url, MODEL, args.refused_bodies, args.max_body_bytes,
                                lambda: _rss_now(servers)) for _ in range(args.refused_rounds)]
        if soak:  # the quarantined holds a send may still read, long after the clients stopped
            soak["left_after_refused"] = _left(servers, 0.0)
    finally:
        servers.stop()
    refused = [{**row, "round": i, "rss": rss_rows(row.pop("rss_before"), row.pop("rss_after"))}
               for i, rows in enumerate(rounds, start=1) for row in rows]
    return {"machine": machine_info(), "model": str(args.model), "clients": args.clients,
            "deployment": "helixserve launch: 1 ctx + gen world dp 1 x cp 2 (kv_source ucx), CPU",
            "malloc_arena_max": args.malloc_arena_max, **soak,
            "refused_bodies": {"bodies_per_case": args.refused_bodies, "max_body_bytes": args.max_body_bytes,
                               "cases": refused, "rounds": round_growth(refused)}}


def _clients_phase(servers: Servers, args) -> dict:  # noqa: ANN001
    warm = asyncio.run(_soak_warmup(servers, args))
    rss_start = _rss_now(servers)
    began = time.monotonic()
    records, faults, held = asyncio.run(_soak(servers, args, began))
    wall = time.monotonic() - began
    left = _left(servers, args.settle)
    return {"seconds": args.seconds, "wall_s": wall, "warmup_requests": warm,
            "statuses": _statuses(records), "latency": _latency(records), "faults": faults,
            "rss": rss_rows(rss_start, _rss_now(servers)), "left_allocated": left, "slowloris": held}


async def _soak_warmup(servers: Servers, args) -> int:  # noqa: ANN001
    """One request of each kind, unrecorded (first forwards are slow)."""
    records: list = []
    await asyncio.gather(*(_client(i, servers.router_url, time.monotonic() + 0.1, records, 0.0, args.timeout)
                           for i in range(len(KINDS))))
    return len(records)


def _statuses(records: list) -> list[dict]:
    counts = Counter((kind, status) for kind, status, _, _ in records)
    return [{"kind": kind, "status": status, "requests": n} for (kind, status), n in sorted(counts.items())]


def _latency(records: list) -> list[dict]:
    rows = []
    for kind in sorted({r[0] for r in records}) + ["all"]:
        ok = [r[2] for r in records if r[1] == "200" and kind in ("all", r[0])]
        total = sum(1 for r in records if kind in ("all", r[0]))
        rows.append({"kind": kind, "requests": total, "ok": len(ok),
                     "p50_ms": 1e3 * _pct(ok, 50) if ok else None, "p99_ms": 1e3 * _pct(ok, 99) if ok else None})
    return rows


def report(payload: dict) -> str:
    parts = _soak_report(payload) if "statuses" in payload else []
    parts.append(refused_table(payload["refused_bodies"]))
    return "\n\n".join(parts)


def _soak_report(payload: dict) -> list[str]:
    return [markdown_table(["kind", "status", "requests"],
                           [[r["kind"], r["status"], r["requests"]] for r in payload["statuses"]]),
            markdown_table(["kind", "requests", "ok", "p50 ms", "p99 ms"],
                           [[r["kind"], r["requests"], r["ok"], r["p50_ms"], r["p99_ms"]] for r in payload["latency"]]),
            markdown_table(["fault", "at s", "pid", "router ready again after s"],
                           [[f["fault"], f.get("at_s"), f.get("pid"), f.get("recovered_s") or f.get("error")]
                            for f in payload["faults"]]),
            markdown_table(["process", "pid start", "pid end", "RSS start MB", "RSS end MB", "growth MB"],
                           [[r["process"], r["pid_start"], r["pid_end"], r["rss_start_mb"], r["rss_end_mb"],
                             r["growth_mb"] if not r["restarted"] else "restarted"] for r in payload["rss"]]),
            markdown_table(list(payload["left_allocated"]), [list(payload["left_allocated"].values())]),
            markdown_table(list(payload["slowloris"]), [list(payload["slowloris"].values())]),
            "left allocated after the refused bodies: " + json.dumps(payload["left_after_refused"])]


def main() -> None:
    import tempfile

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "checkpoints" / MODEL),
                        help="checkpoint directory (a missing kimi-k3-tiny one is made)")
    parser.add_argument("--minutes", type=float, default=3.0, help="length of the run (default 3)")
    parser.add_argument("--seconds", type=float, default=None, help="length in seconds (overrides --minutes)")
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default 32; quick: 6)")
    parser.add_argument("--error-pause", type=float, default=0.25, help="a client's pause after an error (s)")
    parser.add_argument("--idle-connections", type=int, default=100, help="idle connections held during the run")
    parser.add_argument("--slow-connections", type=int, default=50,
                        help="slow-header connections (a header line a second) held during the run")
    parser.add_argument("--refused-bodies", type=int, default=None,
                        help="large bodies of each refused case per round, sent after the run (default 24; quick: 2)")
    parser.add_argument("--refused-rounds", type=int, default=2,
                        help="rounds of refused bodies in the same deployment (default 2)")
    parser.add_argument("--refused-only", action="store_true",
                        help="no clients, faults or slowloris: only the refused bodies")
    parser.add_argument("--malloc-arena-max", type=int, default=None,
                        help="start the deployment with MALLOC_ARENA_MAX set to this (glibc)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="the deployment's limits.max_body_bytes")
    parser.add_argument("--settle", type=float, default=45.0,
                        help="longest wait for the workers to free all (s; > the ctx's pickup_timeout_s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "bench-soak.log"),
                        help="where the servers' output goes")
    args = parser.parse_args()
    payload = run(args)
    if not args.refused_only:
        print(f"\n{payload['deployment']}; {payload['clients']} clients for {payload['seconds']:.0f} s "
              f"(faults at 1/3 and 2/3)\n")
    print(f"refused bodies: RSS per process (MB) around {payload['refused_bodies']['bodies_per_case']} "
          f"of each case, MALLOC_ARENA_MAX {payload['malloc_arena_max'] or 'unset'}\n")
    print(report(payload))
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
