"""Transceiver bandwidth: one request's KV + KDA state, ctx -> gen over UCX, next to raw peers.

Two processes on this host: a ctx worker (KVSender over a Kimi-Linear-48B-shaped cache, bf16,
tokens_per_block 16) and a gen rank (a KVReceiver driven as the engine serves: RankTransfers, cp = 1). For each prompt
length the whole request (7 MLA layers of blocks, 20 KDA layers of fp32 state and conv state, plus
AUX) moves from begin() to "ready" on the gen side: control RPC, plan check, every message,
scatter. In the same run, between the same two processes and the same ucxx setup (progress
thread, no endpoint error handling): a raw ucxx tag send of ONE contiguous buffer of the same
size, and the same bytes as raw ucxx sends of the request's own message sizes (all posted at
once, no control plane): the gap between the two raw rows is what the split into messages costs,
the gap between helixserve and the second is the per-request overhead (control round trip,
planning, posting from Python). Where available, also a NIXL WRITE of one buffer (nixl-cu12, UCX backend, DRAM; pass
``--nixl-path`` to a ``pip install --target`` dir) and ``ucx_perftest -t tag_bw`` (from the libucx
wheel). GB/s = 1e9 bytes/s, median of ``--reps`` after one warm-up. Then the fan-in rows
(``bench/_transceiver_fan.py``): the longest prompt to every rank of a gen CP group of 1, 2 or 4,
from a ctx worker of one rank and from a ctx world of 2 (each gen rank pulls from the ctx rank
holding its part), with GB/s over the request's bytes and each ctx world's time over the one-rank
ctx's to the same gen group. Every row gives the request's messages, per (ctx rank, gen rank) pair
(the most of any pair) and in total, as both sides cut them; a last table gives one pair's
messages for the same prompts with the preset's layers repeated 1, 2 and 4 times, to gen cp 1 and cp 4
(``bench/_transceiver_messages.py``).

NIXL is probed once up front (import, then creating an agent in a child process, bounded); when it
cannot run here that peer is skipped with the reason printed (and recorded as ``nixl_skipped``),
and a NIXL run that gives no result is not retried for the next size. Every wait is bounded, and
``--quick`` uses short bounds so it stays under a minute on CPU.

    python bench/transceiver.py --quick --out bench/results/transceiver_quick.json
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, write_json  # noqa: E402
from _transceiver_fan import MESSAGE_BYTES as FAN_MESSAGE_BYTES, bench_fan, fan_request_bytes  # noqa: E402
from _transceiver_messages import message_figures, over_layers, preset_layout  # noqa: E402
from helixserve.transceiver.layout import ShardSpec, plan_messages, shard_segments  # noqa: E402
from _transceiver_peers import payload_bound, raw_round, receive_one, receive_raw, serve_ctx, serving_receiver  # noqa: E402

TPB = 16
PRESET = "kimi-linear-48b"


def _setup(max_tokens: int, message_mib: float, window_mib: float):
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    torch.set_num_threads(1)
    cfg = get_preset(PRESET)
    num_blocks = -(-max_tokens // TPB)
    caches = allocate_model_caches(cache_spec_for(cfg, torch.bfloat16, TPB), num_blocks, 1)
    for pool in caches.tensors():
        pool.fill_(1.0)  # touch every page before timing
    config = TransceiverConfig(kv_transfer_timeout_ms=60_000, message_bytes=int(message_mib * 2**20),
                               send_window_bytes=int(window_mib * 2**20))
    return config, layout_for(cfg, torch.bfloat16, TPB, PRESET), caches, CacheManager(num_blocks, 1, TPB)


def _ctx_main(max_tokens: int, message_mib: float, window_mib: float, inbox, outbox) -> None:
    import torch

    from helixserve.kvcache.pools import host_zeros
    from helixserve.transceiver.ctx.sender import KVSender
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    config, layout, caches, manager = _setup(max_tokens, message_mib, window_mib)
    raw = host_zeros((payload_bound(caches),), torch.uint8).fill_(1)  # pool-like memory, page-touched
    freed = mp.SimpleQueue()
    sender = KVSender(config, layout, caches, freed.put)
    plane = UcxxDataPlane(progress_thread=True, wakeup_on_completion=False)  # raw ucxx: no notifier
    outbox.put((sender.start().model_dump(), layout.model_dump(), plane.address))
    serve_ctx(sender, manager, freed, plane, raw, inbox, outbox, tick_s=0.0002)


def _gen_main(max_tokens: int, message_mib: float, window_mib: float, inbox, outbox) -> None:
    import torch

    from helixserve.kvcache.pools import host_zeros
    from helixserve.transceiver.gen.receiver import KVReceiver
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    config, layout, caches, manager = _setup(max_tokens, message_mib, window_mib)
    raw = host_zeros((payload_bound(caches),), torch.uint8)  # the same (huge-page) memory as the pools
    receiver = KVReceiver(config, layout)
    rx = serving_receiver(receiver, caches)
    plane = UcxxDataPlane(progress_thread=True, wakeup_on_completion=False)  # raw ucxx: no notifier
    outbox.put(plane.address)
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "connect":
            plane.connect("ctx", cmd[1])
            outbox.put("connected")
        elif cmd[0] == "transfer":
            _, rid, num_tokens, endpoint = cmd
            _, elapsed = receive_one(rx, manager, layout, rid, num_tokens, endpoint)
            outbox.put((elapsed, receiver.metrics.bytes_transferred))
        elif cmd[0] in ("raw", "raw_messages"):
            receive_raw(plane, raw, cmd, inbox, outbox, tick_s=0.0002)
    receiver.close()
    plane.close()


def _message_pieces(num_tokens: int, message_mib: float, first_tag: int) -> list[tuple[int, int, int]]:
    """(wire tag, offset, nbytes) of one request's messages (cp 1), back to back in one buffer."""
    spec = ShardSpec(preset_layout(PRESET, TPB), num_tokens)
    messages = plan_messages(shard_segments(spec), int(message_mib * 2**20))
    starts = [0]
    for m in messages[:-1]:
        starts.append(starts[-1] + m.nbytes)
    return [(first_tag + m.index, start, m.nbytes) for m, start in zip(messages, starts, strict=True)]


def bench_ucx(token_counts: list[int], reps: int, message_mib: float, window_mib: float) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    queues = {name: (ctx.Queue(), ctx.Queue()) for name in ("ctx", "gen")}
    setup = (max(token_counts), message_mib, window_mib)
    procs = [ctx.Process(target=_ctx_main, args=(*setup, *queues["ctx"])),
             ctx.Process(target=_gen_main, args=(*setup, *queues["gen"]))]
    for proc in procs:
        proc.start()
    (ctx_in, ctx_out), (gen_in, gen_out) = queues["ctx"], queues["gen"]
    endpoint, _, ctx_address = ctx_out.get(timeout=120)
    gen_address = gen_out.get(timeout=120)
    ctx_in.put(("connect", gen_address)), gen_in.put(("connect", ctx_address))
    assert (ctx_out.get(timeout=30), gen_out.get(timeout=30)) == ("connected", "connected")
    out, serial, nbytes = {}, iter(range(10**6)), 0  # nbytes: the gen's running byte count
    for num_tokens in token_counts:
        transfer, raw, raw_messages = [], [], []
        for rep in range(reps + 1):
            rid = f"r{next(serial)}"
            ctx_in.put(("hold", rid, num_tokens))
            assert ctx_out.get(timeout=60)[0] == "held"
            before = nbytes
            gen_in.put(("transfer", rid, num_tokens, endpoint))
            elapsed, nbytes = gen_out.get(timeout=120)
            payload = nbytes - before
            raw_s = raw_round(queues["ctx"], queues["gen"], ("raw", payload, next(serial)))
            pieces = _message_pieces(num_tokens, message_mib, (1 << 40) + (next(serial) << 12))
            assert sum(n for _, _, n in pieces) == payload, (num_tokens, payload)
            raw_messages_s = raw_round(queues["ctx"], queues["gen"], ("raw_messages", pieces))
            if rep:  # the first round warms up
                transfer.append(elapsed)
                raw.append(raw_s)
                raw_messages.append(raw_messages_s)
        out[num_tokens] = {"bytes": payload, "transfer_s": transfer, "raw_ucxx_s": raw,
                           "raw_ucxx_messages_s": raw_messages, "num_messages": len(pieces)}
    for inbox in (ctx_in, gen_in):
        inbox.put(("stop",))
    for proc in procs:
        proc.join(timeout=30)
    return out


def _nixl_main(role: str, nbytes: int, reps: int, nixl_path: str, inbox, outbox) -> None:
    sys.path.insert(0, nixl_path)
    import torch

    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    from helixserve.kvcache.pools import host_zeros

    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    buffer = host_zeros((nbytes,), torch.uint8)
    if role == "initiator":
        buffer.fill_(1)
    agent.register_memory(buffer)
    descs = agent.get_xfer_descs(buffer)
    if role == "target":
        outbox.put((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
        inbox.get()
        return
    metadata, remote = inbox.get()
    peer = agent.add_remote_agent(metadata)
    handle = agent.initialize_xfer("WRITE", descs, agent.deserialize_descs(remote), peer, b"done")
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        agent.transfer(handle)
        while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
            pass
        assert state == "DONE"
        times.append(time.perf_counter() - start)
    outbox.put(times[1:])


def nixl_unavailable(nixl_path: str | None, timeout_s: float = 20.0) -> str | None:
    """Why NIXL cannot run here (None: it can): an import check, then a bounded probe in a child
    process that creates an agent with the UCX backend (a broken install can hang or abort there)."""
    import importlib.util

    saved = list(sys.path)
    try:
        if nixl_path:
            sys.path.insert(0, nixl_path)
        names = [n for n in ("nixl_cu12", "nixl") if importlib.util.find_spec(n) is not None]
    finally:
        sys.path[:] = saved
    if not names:
        return f"neither nixl_cu12 nor nixl is importable{f' from {nixl_path}' if nixl_path else ''} (pass --nixl-path)"
    probe = (f"import sys; sys.path.insert(0, {nixl_path or ''!r}); from {names[0]}._api import nixl_agent, "
             "nixl_agent_config; nixl_agent('probe', nixl_agent_config(backends=['UCX']))")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"creating a NIXL agent did not finish within {timeout_s:.0f} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"creating a NIXL agent failed: {lines[-1] if lines else f'exit {done.returncode}'}"
    return None


def bench_nixl(nbytes: int, reps: int, nixl_path: str | None, timeout_s: float) -> list[float] | None:
    ctx = mp.get_context("spawn")
    a_to_b, b_to_a, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    path = nixl_path or ""
    target = ctx.Process(target=_nixl_main, args=("target", nbytes, reps, path, a_to_b, b_to_a))
    initiator = ctx.Process(target=_nixl_main, args=("initiator", nbytes, reps, path, b_to_a, results))
    target.start(), initiator.start()
    try:
        return results.get(timeout=timeout_s)
    except Exception:
        return None
    finally:
        a_to_b.put("stop")
        for proc in (target, initiator):
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def bench_perftest(nbytes: int, reps: int, timeout_s: float) -> float | None:
    """ucx_perftest -t tag_bw overall bandwidth in GB/s, or None when it does not run here."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    env = {**os.environ, "LD_LIBRARY_PATH": f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    port = str(20000 + os.getpid() % 20000)
    args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(reps), "-p", port]
    server = subprocess.Popen([str(binary), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        client = subprocess.run([str(binary), "127.0.0.1", *args], env=env, capture_output=True, text=True,
                                timeout=timeout_s)
        match = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)", client.stdout)
        return float(match.group(1)) * 2**20 / 1e9 if match else None
    except (subprocess.TimeoutExpired, OSError):
        return None
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--message-mib", type=float, default=16.0, help="TransceiverConfig.message_bytes in MiB")
    parser.add_argument("--window-mib", type=float, default=64.0, help="TransceiverConfig.send_window_bytes in MiB")
    parser.add_argument("--nixl-path", default=None, help="directory holding nixl_cu12 (pip install --target)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: pools on the GPU, helixserve vs raw ucxx vs a device copy (bench/_transceiver_cuda.py)")
    parser.add_argument("--profile", action="store_true",
                        help="with --device cuda: cProfile the gen's pulled transfers (top lines in the JSON)")
    args = parser.parse_args()
    if args.device == "cuda":
        return main_cuda(args)
    token_counts = [512, 2048] if args.quick else [4096, 16384, 32768]
    reps = args.reps or (5 if args.quick else 7)
    if args.profile:
        print("--profile: only with --device cuda (the pulled path); ignored")
    ucx = bench_ucx(token_counts, reps, args.message_mib, args.window_mib)
    records, nixl_skip = main_rows(ucx, args, reps)
    message_bytes = int(args.message_mib * 2**20)
    layer_headers, layer_rows, layers = over_layers(preset_layout(PRESET, TPB), [1, token_counts[-1]], message_bytes)
    print(f"\nmessages per (ctx rank, gen rank) pair from a ctx tp 1 (the pair's MiB) with {PRESET}'s layers "
          "repeated\n")
    print(markdown_table(layer_headers, layer_rows))
    fan = fan_in_rows(token_counts[-1], reps)
    write_json(args.out, {"bench": "transceiver", "preset": PRESET, "tokens_per_block": TPB, "reps": reps,
                          "message_bytes": message_bytes, "send_window_bytes": int(args.window_mib * 2**20),
                          "nixl_skipped": nixl_skip, "machine": machine_info(), "results": records,
                          "messages_over_layers": layers, "fan_in": fan})


def main_rows(ucx: dict[int, dict], args, reps: int) -> tuple[list[dict], str | None]:  # noqa: ANN001
    """The main table (helixserve next to the raw peers, per prompt length), printed; its records
    and why NIXL was skipped (None: it ran)."""
    nixl_skip = nixl_unavailable(args.nixl_path, 10 if args.quick else 30)
    if nixl_skip:
        print(f"NIXL write: skipped, {nixl_skip}")
    rows, records = [], []
    for num_tokens, r in ucx.items():
        gbps = {"helixserve": r["bytes"] / statistics.median(r["transfer_s"]) / 1e9,
                "raw ucxx": r["bytes"] / statistics.median(r["raw_ucxx_s"]) / 1e9,
                "raw ucxx, same messages": r["bytes"] / statistics.median(r["raw_ucxx_messages_s"]) / 1e9}
        nixl = None if nixl_skip else bench_nixl(r["bytes"], reps, args.nixl_path, 15 if args.quick else 180)
        if nixl is None and not nixl_skip:
            nixl_skip = f"the NIXL write of {r['bytes']} bytes gave no result; not tried again"
            print(f"NIXL write: {nixl_skip}")
        gbps["NIXL write"] = r["bytes"] / statistics.median(nixl) / 1e9 if nixl else None
        gbps["ucx_perftest"] = bench_perftest(r["bytes"], max(reps, 3), 20 if args.quick else 300)
        best = max(v for k, v in gbps.items() if k != "helixserve" and v)
        # paired per round (each helixserve transfer is followed by its raw send): robust to load drift
        paired = statistics.median(raw_s / ours for ours, raw_s in zip(r["transfer_s"], r["raw_ucxx_s"]))
        messages = message_figures(preset_layout(PRESET, TPB), num_tokens, 1, 1, int(args.message_mib * 2**20))
        assert messages["messages_total"] == r["num_messages"], (messages, r["num_messages"])
        rows.append([num_tokens, r["bytes"] / 2**20, messages["messages_per_pair"], messages["messages_total"],
                     *gbps.values(), paired, gbps["helixserve"] / best])
        records.append({"tokens": num_tokens, "bytes": r["bytes"], **messages, "gbps": gbps,
                        "vs_raw_ucxx": paired, "ratio_vs_best_peer": gbps["helixserve"] / best,
                        "transfer_s": r["transfer_s"], "raw_ucxx_s": r["raw_ucxx_s"],
                        "raw_ucxx_messages_s": r["raw_ucxx_messages_s"]})
    headers = ["prompt tokens", "MiB", "messages per pair", "messages total", "helixserve GB/s", "raw ucxx GB/s",
               "raw ucxx, same messages GB/s", "NIXL write GB/s", "ucx_perftest GB/s",
               "helixserve / raw ucxx (paired median)", "helixserve / best peer"]
    print(f"\n{PRESET} request (bf16 KV, fp32 KDA state), ctx -> gen, 2 processes, one host\n")
    print(markdown_table(headers, rows))
    return records, nixl_skip


def fan_in_rows(num_tokens: int, reps: int) -> list[dict]:
    """The fan-in table (bench/_transceiver_fan.py): gen cp 1, 2 and 4 from ctx tp 1 and from ctx tp 2."""
    seconds = bench_fan(num_tokens, reps)
    nbytes = fan_request_bytes(num_tokens)
    layout = preset_layout(PRESET, TPB)
    rows, out = [], []
    for (tp, cp), times in seconds.items():
        base = seconds[(1, cp)]
        paired = statistics.median(b / a for a, b in zip(base, times))
        median_s = statistics.median(times)
        messages = message_figures(layout, num_tokens, tp, cp, FAN_MESSAGE_BYTES)
        rows.append([f"ctx tp {tp} -> gen cp {cp}", messages["messages_per_pair"], messages["messages_total"],
                     median_s * 1e3, nbytes / median_s / 1e9, paired])
        out.append({"tokens": num_tokens, "ctx_tp": tp, "gen_cp": cp, "seconds": times, "bytes": nbytes,
                    "over_tp1": paired, **messages})
    print(f"\nfan-in: one {num_tokens}-token request ({nbytes / 2**20:.1f} MiB) to every rank of a gen CP "
          "group, 2 processes\n")
    print(markdown_table(["pair", "messages per pair", "messages total", "ms (median)", "GB/s",
                          "over ctx tp 1 -> same cp (paired median)"], rows))
    return out


def main_cuda(args) -> None:
    import _transceiver_cuda

    headers, rows, records = _transceiver_cuda.run(args.quick, args.reps, args.profile)
    print("\none request ctx -> gen, 2 processes on one GPU (pools on the device, 64-token pages)\n")
    print(markdown_table(headers, rows))
    write_json(args.out, {"bench": "transceiver", "device": "cuda", "tokens_per_block": _transceiver_cuda.TPB,
                          "machine": machine_info(), "results": records})


if __name__ == "__main__":
    main()
