"""`bench/transceiver.py --device cuda`: one request's KV + KDA state between two processes on one GPU.

Pools on the GPU in both processes (ctx: a KVSender; gen: KVReceivers driven as the engine serves
them, `RankTransfers` over the gen server's paced receiver, cp = 1, 64-token pages, bf16 KV, fp32
KDA state). Per request shape, in the same run and between the same two processes: helixserve's
transfer as it serves (the cache allocated to the request agreed ready: the copy out of the ctx's
pools over CUDA IPC on the ctx's PullGrant, the lease check, the acknowledgement sent), the same
with the gen's CPU spinning for 2 ms first (``granted_warm``: the engine thread already awake
rather than woken from a queue wait, as after the previous step), the same right after a tiny
copy of the gen's own on the GPU (``granted_gpu``: the GPU last ran this process's context, not
the ctx's), the same copy asked for with RequestShard first (a request without a grant), the same request over the tagged
UCX stream (``cuda_ipc: false``, what a gen on another host uses), a raw ucxx tag send of ONE device
buffer of the same size (UCX's cuda_ipc; receive posted first, as the CPU bench), and a
device-to-device copy of the same bytes in one process (``Tensor.copy_``, the ceiling). Times are
medians of ``reps`` after one warm-up round; GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

from _transceiver_peers import payload_bound, raw_round, receive_one, receive_raw, serve_ctx, serving_receiver

TPB = 64
SHAPES = [("kimi-k3-mid", 512), ("kimi-k3-mid", 4096), ("kimi-linear-48b", 4096), ("kimi-linear-48b", 32768)]
QUICK_SHAPES = [("kimi-k3-mid", 512), ("kimi-linear-48b", 4096)]


def _setup(preset: str, max_tokens: int, cuda_ipc: bool = True):
    import torch

    from helixserve.cache_layout import cache_spec_for
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    cfg = get_preset(preset)
    num_blocks = -(-max_tokens // TPB) * 2 + 2
    caches = allocate_model_caches(cache_spec_for(cfg, torch.bfloat16, TPB), num_blocks, 2, device="cuda")
    for i, pool in enumerate(caches.tensors()):
        pool.copy_(torch.randn(pool.shape, dtype=torch.float32, device="cuda").to(pool.dtype) + i)
    config = TransceiverConfig(kv_transfer_timeout_ms=60_000, cuda_ipc=cuda_ipc)
    return config, layout_for(cfg, torch.bfloat16, TPB, preset), caches, CacheManager(num_blocks, 2, TPB)


def _ctx_main(preset: str, max_tokens: int, inbox, outbox) -> None:
    import torch

    from helixserve.transceiver.ctx.sender import KVSender
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    config, layout, caches, manager = _setup(preset, max_tokens)
    freed = mp.SimpleQueue()
    sender = KVSender(config, layout, caches, freed.put)
    plane = UcxxDataPlane(progress_thread=True, wakeup_on_completion=False)
    raw = torch.ones(payload_bound(caches), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    outbox.put((sender.start().model_dump(), plane.address))
    serve_ctx(sender, manager, freed, plane, raw, inbox, outbox, tick_s=0.00005)


PHASES = ("allocated", "inbound", "granted_ok", "planned", "table", "graph_replay", "replayed", "copy_issued",
          "launched", "request", "reply", "done", "acked", "settled", "resulted", "forgot", "polled")
MODES = ("granted", "granted_warm", "granted_gpu", "asked", "tagged")  # granted: as served (the ctx's answer carries a PullGrant)
WARM_SPIN_S = 0.002  # granted_warm: the gen spins this long first (a CPU awake, not woken from a queue wait)
PROFILE_LINES = 40  # --profile: this many lines of the gen's pull-path profile go into the JSON


def _record_phases(marks: dict[str, float]) -> None:
    """Stamp the serving path's phases of the request in flight (bench instrumentation only): the
    cache allocated, the Inbound built (its shard spec), the grant's MAC checked, the shard's unit
    groups built (`PullPair.groups`), the unit copy issued (inside it: the request table built,
    the graph's replay begun after the table's upload, the replay done), the pull started, RequestShard sent (asked, tagged), its reply seen, the copy seen
    done, the acknowledgement sent, the session settled, the poller's result built, the settled
    transfer forgotten, and the end of the last poll before the agreement."""
    import torch

    from helixserve.kernels.copy import triton_units, unit_graphs
    from helixserve.kvcache.manager import CacheManager
    from helixserve.transceiver import base, polling
    from helixserve.transceiver.gen import asked_pull, granted_pull, inbound, pull, receiver

    def after(name: str, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = fn(*args, **kwargs)
            marks[name] = time.perf_counter()
            return out
        return run

    def before(name: str, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            marks[name] = time.perf_counter()
            return fn(*args, **kwargs)
        return run

    CacheManager.allocate = after("allocated", CacheManager.allocate)
    inbound.Inbound.__init__ = after("inbound", inbound.Inbound.__init__)
    granted_pull.grant_matches = after("granted_ok", granted_pull.grant_matches)
    pull.PullPair.groups = after("planned", pull.PullPair.groups)
    triton_units.request_table = after("table", triton_units.request_table)
    unit_graphs.UnitGraphs.replay_slot = after("replayed", unit_graphs.UnitGraphs.replay_slot)
    torch.cuda.CUDAGraph.replay = before("graph_replay", torch.cuda.CUDAGraph.replay)
    pull.UnitCopier.copy = after("copy_issued", pull.UnitCopier.copy)
    inbound.Inbound.request = after("request", inbound.Inbound.request)
    inbound.Inbound.answer = before("reply", inbound.Inbound.answer)
    asked_pull.AskedPull._start_pull = after("launched", asked_pull.AskedPull._start_pull)
    granted_pull.GrantedPull.start = after("launched", granted_pull.GrantedPull.start)
    inbound.Inbound._finish = before("done", inbound.Inbound._finish)
    receiver.KVReceiver.send_ack = after("acked", receiver.KVReceiver.send_ack)
    base.TransferSession._settle = after("settled", base.TransferSession._settle)
    polling.TransferPoller._result = after("resulted", polling.TransferPoller._result)
    receiver.KVReceiver.forget = after("forgot", receiver.KVReceiver.forget)
    receiver.KVReceiver.poll = after("polled", receiver.KVReceiver.poll)


def _gen_main(preset: str, max_tokens: int, inbox, outbox, profile: bool = False) -> None:
    import cProfile
    import io
    import pstats

    import torch

    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.control import target
    from helixserve.transceiver.gen.receiver import KVReceiver
    from helixserve.transceiver.ucxx_backend import UcxxDataPlane

    config, layout, caches, manager = _setup(preset, max_tokens)
    marks: dict[str, float] = {}
    _record_phases(marks)
    tagged_config = config.model_copy(update={"cuda_ipc": False})
    pulling, tagged = KVReceiver(config, layout), KVReceiver(tagged_config, layout)
    receivers = {"granted": pulling, "granted_warm": pulling, "granted_gpu": pulling, "asked": pulling, "tagged": tagged}
    drivers = {id(rx): serving_receiver(rx, caches) for rx in (pulling, tagged)}
    plane = UcxxDataPlane(progress_thread=True, wakeup_on_completion=False)
    raw = torch.zeros(payload_bound(caches), dtype=torch.uint8, device="cuda")
    copy_src, copy_dst = torch.ones_like(raw), torch.zeros_like(raw)
    profiler = cProfile.Profile() if profile else None
    outbox.put(plane.address)
    while (cmd := inbox.get())[0] != "stop":
        if cmd[0] == "connect":
            plane.connect("ctx", cmd[1])
            outbox.put("connected")
        elif cmd[0] == "prime":  # the pull receiver opens the ctx's pools before anything is timed
            endpoint = TransceiverEndpoint.model_validate(cmd[1])
            receiver = receivers["granted"]
            end, pools = time.monotonic() + 30, None
            while pools is None and time.monotonic() < end:
                pools = receiver.pools.get(target(endpoint), receiver.clients.get(endpoint), torch.device("cuda", 0))
                time.sleep(0.01)
            outbox.put(pools is not None)
        elif cmd[0] == "transfer":
            _, mode, rid, num_tokens, endpoint, grant, timed = cmd
            rx = receivers[mode]
            profiling = profiler is not None and mode == "granted" and timed  # (not the warm-up's compiles)
            before = rx.metrics.bytes_transferred
            granted = rx.num_granted
            marks.clear()
            if mode == "granted_warm":
                until = time.perf_counter() + WARM_SPIN_S
                while time.perf_counter() < until:
                    pass
            elif mode == "granted_gpu":  # this process's context just ran on the GPU
                copy_dst[:4096].copy_(copy_src[:4096])
                torch.cuda.synchronize()
            if profiling:
                profiler.enable()
            start, elapsed = receive_one(drivers[id(rx)], manager, layout, rid, num_tokens, endpoint,
                                         grant=grant if mode.startswith("granted") else None)
            if profiling:
                profiler.disable()
            assert (rx.num_granted - granted) == mode.startswith("granted"), f"{mode}: the grant was not used"
            phases = {k: (v - start) * 1e3 for k, v in marks.items()}
            outbox.put((elapsed, rx.metrics.bytes_transferred - before, phases))
        elif cmd[0] == "raw":
            receive_raw(plane, raw, cmd, inbox, outbox, tick_s=0.00005)
        elif cmd[0] == "copy":
            times = []
            for _ in range(cmd[2] + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                copy_dst[: cmd[1]].copy_(copy_src[: cmd[1]])
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            outbox.put(times[1:])
        elif cmd[0] == "profile":
            text = io.StringIO()
            if profiler is not None:
                for order in ("cumulative", "tottime"):
                    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(PROFILE_LINES)
            outbox.put(text.getvalue())
    for rx in (pulling, tagged):
        rx.close()
    plane.close()


def bench_preset(preset: str, token_counts: list[int], reps: int, profile: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    (ctx_in, ctx_out), (gen_in, gen_out) = (ctx.Queue(), ctx.Queue()), (ctx.Queue(), ctx.Queue())
    setup = (preset, max(token_counts))
    procs = [ctx.Process(target=_ctx_main, args=(*setup, ctx_in, ctx_out)),
             ctx.Process(target=_gen_main, args=(*setup, gen_in, gen_out, profile))]
    for proc in procs:
        proc.start()
    try:
        endpoint, ctx_address = ctx_out.get(timeout=300)
        gen_address = gen_out.get(timeout=300)
        ctx_in.put(("connect", gen_address)), gen_in.put(("connect", ctx_address))
        assert (ctx_out.get(timeout=60), gen_out.get(timeout=60)) == ("connected", "connected")
        gen_in.put(("prime", endpoint))
        pulls = gen_out.get(timeout=60)
        serial = iter(range(10**6))
        records = []
        for num_tokens in token_counts:
            times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "raw")}
            phases: dict[str, list[dict]] = {"granted": [], "granted_warm": [], "granted_gpu": [], "asked": []}
            payload = 0
            for rep in range(reps + 1):
                for mode in MODES:
                    rid = f"r{next(serial)}"
                    ctx_in.put(("hold", rid, num_tokens))
                    held, grant = ctx_out.get(timeout=60)
                    assert held == "held" and grant is not None, "the ctx granted no pull"
                    gen_in.put(("transfer", mode, rid, num_tokens, endpoint, grant, rep > 0))
                    elapsed, payload, stamps = gen_out.get(timeout=120)
                    if rep:
                        times[mode].append(elapsed)
                        if mode in phases:
                            phases[mode].append(stamps)
                raw_s = raw_round((ctx_in, ctx_out), (gen_in, gen_out), ("raw", payload, next(serial)))
                if rep:
                    times["raw"].append(raw_s)
            gen_in.put(("copy", payload, reps))
            copy_s = gen_out.get(timeout=120)
            med = {k: statistics.median(v) for k, v in times.items()} | {"copy": statistics.median(copy_s)}
            records.append({
                "preset": preset, "tokens": num_tokens, "bytes": payload, "mib": payload / 2**20,
                "pulled_over_cuda_ipc": pulls,
                "gbps": {k: payload / v / 1e9 for k, v in med.items()},
                "latency_ms": {k: v * 1e3 for k, v in med.items()},
                "ratio": med["copy"] / med["granted"], "vs_raw_ucxx": med["raw"] / med["granted"],
                "asked_vs_raw_ucxx": med["raw"] / med["asked"], "tagged_vs_raw_ucxx": med["raw"] / med["tagged"],
                **{f"{mode}_phases_ms": {k: statistics.median(p[k] for p in stamps) for k in PHASES
                                         if all(k in p for p in stamps)} for mode, stamps in phases.items()},
                "times_s": times | {"copy": copy_s}})
        if profile:  # every pull transfer of this preset, on the gen (cProfile, cumulative)
            gen_in.put(("profile",))
            records[-1]["gen_pull_profile"] = gen_out.get(timeout=60)
        return records
    finally:
        for inbox in (ctx_in, gen_in):
            inbox.put(("stop",))
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def run(quick: bool, reps: int | None, profile: bool = False) -> tuple[list[str], list[list], list[dict]]:
    shapes = QUICK_SHAPES if quick else SHAPES
    reps = reps or (3 if quick else 7)
    records = []
    for preset in dict.fromkeys(p for p, _ in shapes):
        records += bench_preset(preset, [t for p, t in shapes if p == preset], reps, profile)
    headers = ["preset", "prompt tokens", "MiB", "helixserve GB/s", "ms", "asked pull ms", "tagged UCX GB/s",
               "raw ucxx GB/s", "device copy GB/s", "ours / device copy", "ours / raw ucxx", "warm CPU ms", "warm GPU ms",
               "granted: ms to unit groups",
               "to copy issued", "to done", "asked: ms to reply"]
    rows = [[r["preset"], r["tokens"], r["mib"], r["gbps"]["granted"], r["latency_ms"]["granted"],
             r["latency_ms"]["asked"], r["gbps"]["tagged"], r["gbps"]["raw"], r["gbps"]["copy"], r["ratio"],
             r["vs_raw_ucxx"], r["latency_ms"]["granted_warm"], r["latency_ms"]["granted_gpu"], *(r["granted_phases_ms"].get(k) for k in ("planned", "copy_issued", "done")),
             r["asked_phases_ms"].get("reply")] for r in records]
    return headers, rows, records
