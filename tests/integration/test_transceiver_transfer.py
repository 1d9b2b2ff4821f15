"""ctx -> gen transfers over REAL UCX and gRPC between processes.

Processes (started once for the module): a ctx worker running the single-process engine on the
tiny checkpoints (kimi-k3-tiny and kimi-linear-tiny, tokens_per_block = 4) with one KVSender per
model; a gen world of 4 ranks (dp = 2 x cp = 2, gloo) whose ranks receive shards into their own
pools as a gen world's ranks do: ``RankTransfers`` over the gen server's ``PacedKVReceiver`` and the
``TransferConsensus`` over their CP group (``tests.unit.transceiver_harness.RankReception``). Gen rank 0 also runs a full
single-process engine per model (cp = 1) that decodes from a received cache.

Checked: each rank's received cache equals, byte for byte, its shard of the ctx cache (cp = 2,
and two requests on two DP groups at once); cp = 1 decoding from the received state gives the
same tokens as the engine decoding after its own prefill; a killed ctx, a stalled CP rank, a
layout mismatch and an expired hold each end with a named error within the timeout (the killed
ctx before it), a cancel mid-transfer (the client went away: the leader's abort reaches every rank
of the group) ends without one, and nothing is left allocated on either side. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from itertools import count

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.protocol import transfer_pb2 as pb  # noqa: E402
from helixserve.protocol.disagg import DisaggregatedParams  # noqa: E402
from helixserve.transceiver.gen.control_client import ControlClient  # noqa: E402

MODELS = ("kimi-k3-tiny", "kimi-linear-tiny")
TPB = 4
GEN_TIMEOUT_MS = 2000
WAIT_S = 30.0  # the longest any single command may take (each has its own tighter bounds)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(23)]  # 6 blocks of 4, the last one partial


def _gen_config():
    from helixserve.config_transceiver import TransceiverConfig

    return TransceiverConfig(kv_transfer_timeout_ms=GEN_TIMEOUT_MS, message_bytes=1024, rpc_timeout_ms=2000,
                             drain_timeout_ms=1000)


def _quiet() -> None:
    import logging

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


def _exit(results) -> None:
    """Leave without the interpreter's slow teardown (everything was closed explicitly)."""
    results.close()
    results.join_thread()
    os._exit(0)


def _stall(num_messages: int | None, cp_rank: int | None = None) -> None:
    """In a ctx process: stop posting after `num_messages` per stream (of `cp_rank` only)."""
    from helixserve.transceiver.ctx.outbound import Outbound

    original = getattr(Outbound, "_original_post", Outbound._post)
    Outbound._original_post = original

    def post(self, plane, index):
        stalled = num_messages is not None and index >= num_messages
        if stalled and (cp_rank is None or self.cp_rank == cp_rank):
            return False
        return original(self, plane, index)

    Outbound._post = post


# ---------------------------------------------------------------------------------- ctx worker

def _ctx_main(checkpoints: dict, commands, results) -> None:
    _quiet()
    from helixserve.config import CacheConfig
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.engine.llm import LLM
    from helixserve.engine.request import SamplingParams
    from helixserve.transceiver.layout import layout_for
    from helixserve.transceiver.ctx.sender import KVSender

    freed: queue.SimpleQueue = queue.SimpleQueue()  # sender thread -> this (engine) thread
    released: dict[str, list[str]] = {m: [] for m in MODELS}
    engines, senders, layouts = {}, {}, {}
    for model in MODELS:
        llm = LLM(checkpoints[model], cache=CacheConfig(tokens_per_block=TPB, memory_budget_mib=2, max_num_seqs=4))
        engines[model] = llm.engine
        layouts[model] = layout_for(llm.model_config, torch.float32, TPB, model)
        senders[model] = KVSender(TransceiverConfig(kv_transfer_timeout_ms=10000), layouts[model],
                                  llm.engine.runner.caches, lambda rid, m=model: freed.put((m, rid)))
        senders[model].start()
    results.put(("ctx", "ready", {m: (senders[m].endpoint.model_dump(), layouts[m].model_dump()) for m in MODELS}))
    while True:
        while not freed.empty():  # on_free runs on the sender thread: release on this thread
            model, rid = freed.get()
            assert engines[model].release(rid)
            released[model].append(rid)
        try:
            tag, cmd, args = commands.get(timeout=0.005)
        except queue.Empty:
            continue
        if cmd == "stop":
            break
        if cmd == "stall":
            _stall(*args)
            results.put(("ctx", tag, None))
        elif cmd == "prefill":
            model, rid, prompt, hold_timeout_s = args
            engine = engines[model]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), hold_cache=True)
            updates = []
            while engine.has_unfinished_requests():
                updates += engine.step()
            handle = engine.cache_manager.get(rid)
            senders[model].hold(rid, handle, len(prompt), [updates[-1].token_id], hold_timeout_s=hold_timeout_s)
            caches, nb = engine.runner.caches, handle.num_logical_blocks
            state = {"mla": {i: p[handle.block_ids[:nb]].clone() for i, p in caches.mla_kv.items()},
                     "kda": {i: p[handle.slot].clone() for i, p in caches.kda_state.items()},
                     "conv": {i: p[handle.slot].clone() for i, p in caches.conv_state.items()}}
            results.put(("ctx", tag, (updates[-1].token_id, state)))
        elif cmd == "stats":
            model = args[0]
            results.put(("ctx", tag, (engines[model].stats(), senders[model].stats(), list(released[model]))))
    for sender in senders.values():
        sender.stop()
    _exit(results)


def _victim_main(commands, results) -> None:
    """A ctx process without a model (random cache contents) that the test kills mid-transfer."""
    _quiet()
    from helixserve.cache_layout import cache_spec_for
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for
    from helixserve.transceiver.ctx.sender import KVSender

    cfg = get_preset("kimi-k3-tiny")
    caches = allocate_model_caches(cache_spec_for(cfg, torch.float32, TPB), 16, 2)
    manager = CacheManager(16, 2, TPB)
    sender = KVSender(TransceiverConfig(kv_transfer_timeout_ms=10000), layout_for(cfg, torch.float32, TPB,
                                                                                 "kimi-k3-tiny"), caches, print)
    endpoint = sender.start()
    _stall(2)  # it sends two messages per stream, then goes quiet until it is killed
    sender.hold("doomed", manager.allocate("doomed", len(PROMPT)), len(PROMPT), [5])
    results.put(("victim", "ready", (endpoint.model_dump(), os.getpid())))
    commands.get(timeout=WAIT_S * 2)


# ---------------------------------------------------------------------------------- gen world

def _received(manager, caches, rid) -> dict:
    handle = manager.get(rid)
    return {"mla": {i: p[handle.block_ids].clone() for i, p in caches.mla_kv.items()},
            "kda": {i: p[handle.slot].clone() for i, p in caches.kda_state.items()},
            "conv": {i: p[handle.slot].clone() for i, p in caches.conv_state.items()}}


def _receive(rx, rid: str, params: DisaggregatedParams, cancel_after: int | None, cp_group) -> dict:
    """begin + check until the group agrees (ready, or failed or cancelled, and freed); bounded.
    ``cancel_after``: the group's leader cancels once that many messages arrived here, and tells
    the group's ranks with the check (one flag per check, as the leader's abort reaches them)."""
    import torch.distributed as dist

    manager = rx.cache_manager
    before = manager.stats()
    start = time.monotonic()
    rx.begin(rid, params)
    out: dict = {}
    while time.monotonic() - start < WAIT_S:
        inbound = rx.receiver.inbounds.get(rid)
        cancel = torch.tensor([int(cancel_after is not None and inbound is not None
                                   and sum(r.is_done for r in inbound.transport.recvs) >= cancel_after)])
        dist.all_reduce(cancel, group=cp_group)
        if cancel.item():
            out["cancelled"] = rx.cancel(rid)
            cancel_after = None
        check = rx.check()
        if rid in check.failed:
            out["error"], out["elapsed"] = check.failed[rid], time.monotonic() - start
        if rid in check.ready:
            out["state"] = _received(manager, rx.caches, rid)
            manager.free(rid)  # (an engine would decode it, then free it)
            break
        if rid in check.freed:
            break
        time.sleep(0.001)
    return {**out, "leaked": _leaked(manager, before)}


def _leaked(manager, before) -> tuple[int, int]:
    after = manager.stats()
    return after.num_used_blocks - before.num_used_blocks, after.num_used_slots - before.num_used_slots


def _decode(engine, rx, rid: str, params: DisaggregatedParams, max_tokens: int) -> dict:
    """cp = 1: receive into the engine's own cache, decode; then the same prompt aggregated."""
    from helixserve.engine.request import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rx.begin(rid, params)
    end = time.monotonic() + WAIT_S
    ready = []
    while not ready and time.monotonic() < end:
        check = rx.check()
        assert not check.failed, check.failed
        ready = check.ready
    assert ready == [rid], "no agreement in time"
    updates = engine.add_prefilled_request(rid, list(params.prompt_token_ids), params.first_gen_tokens, sampling)
    while engine.has_unfinished_requests():
        updates += engine.step()
    engine.add_request("agg-" + rid, list(params.prompt_token_ids), sampling)
    while engine.has_unfinished_requests():
        updates += engine.step()
    tokens = {r: [u.token_id for u in updates if u.request_id == r] for r in (rid, "agg-" + rid)}
    return {"disagg": tokens[rid], "agg": tokens["agg-" + rid], "used": engine.stats().num_used_blocks}


def _gen_main(rank: int, init_method: str, checkpoints: dict, commands, results) -> None:
    _quiet()
    from helixserve.config import CacheConfig
    from helixserve.engine.llm import LLM
    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.models.config import KimiModelConfig
    from helixserve.parallel import Mapping, init_parallel
    from helixserve.transceiver.consensus import TransferConsensus
    from tests.unit.transceiver_harness import RankReception
    from helixserve.transceiver.layout import layout_for
    from helixserve.transceiver.gen.receiver import KVReceiver

    mapping = Mapping(world_size=4, rank=rank, dp=2, cp=2)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=60)
    config = _gen_config()
    receivers, engines = {}, {}
    for model in MODELS:
        cfg = KimiModelConfig.from_pretrained(checkpoints[model])
        layout = layout_for(cfg, torch.float32, TPB, model)
        manager = CacheManager(64, 4, TPB, mapping.cp_rank, mapping.cp)
        manager.allocate("padding", 9)  # this rank's blocks for the shard are not the ctx's ids
        caches = allocate_model_caches(cache_spec_for(cfg, torch.float32, TPB, cfg.kda_num_heads // mapping.cp), 64, 4)
        receivers[model] = RankReception(
            KVReceiver(config, layout, cp_rank=mapping.cp_rank, cp_size=mapping.cp, gen_rank=rank),
            manager, caches, TransferConsensus(groups.cp))
        if rank == 0:
            llm = LLM(checkpoints[model], cache=CacheConfig(tokens_per_block=TPB, memory_budget_mib=2, max_num_seqs=4))
            engines[model] = (llm.engine, RankReception(KVReceiver(config, layout, gen_rank=rank),
                                                        llm.engine.cache_manager, llm.engine.runner.caches))
    results.put((f"gen{rank}", "ready", None))
    while True:
        tag, cmd, args = commands.get(timeout=WAIT_S * 4)
        if cmd == "stop":
            break
        model, rid, params_json, option = args
        params = DisaggregatedParams.model_validate_json(params_json)
        if cmd == "receive":
            cancel_after = option if mapping.cp_rank == 0 else None
            results.put((f"gen{rank}", tag, _receive(receivers[model], rid, params, cancel_after, groups.cp)))
        elif cmd == "decode":
            results.put((f"gen{rank}", tag, _decode(*engines[model], rid, params, option)))
    for rx in [*receivers.values(), *(rx for _, rx in engines.values())]:
        rx.close()
    groups.destroy()
    _exit(results)


# ---------------------------------------------------------------------------------- the test side

class Mailbox:
    """The test side of worker processes: ``results`` carries (name, tag, value) answers; ``wait``
    collects the answers to ``keys``, failing on a dead process or after ``timeout_s``."""

    procs: dict
    inboxes: dict
    results: object
    stash: dict

    def wait(self, keys: list[tuple[str, object]], timeout_s: float = WAIT_S) -> dict:
        end = time.monotonic() + timeout_s
        while not all(k in self.stash for k in keys):
            dead = [n for n, p in self.procs.items() if not p.is_alive()]
            assert not dead, f"processes died: {dead}"
            try:
                name, tag, value = self.results.get(timeout=max(0.01, min(1.0, end - time.monotonic())))
            except queue.Empty:
                assert time.monotonic() < end, f"no answer within {timeout_s}s for {keys}; have {list(self.stash)}"
                continue
            self.stash[(name, tag)] = value
        return {k: self.stash.pop(k) for k in keys}

    def close(self) -> None:
        """Ask every process to stop; kill the ones still running after 10 s."""
        for inbox in self.inboxes.values():
            inbox.put((None, "stop", None))
        end = time.monotonic() + 10
        for name, proc in self.procs.items():
            proc.join(timeout=max(0.1, end - time.monotonic()))
            if proc.is_alive():
                print(f"{name} did not stop; killing it")
                proc.kill()


class World(Mailbox):
    def __init__(self, checkpoints: dict) -> None:
        from helixserve.parallel.ports import free_port

        # forkserver with torch preloaded: five fresh interpreters importing torch on two cores take
        # ~15 s; forks of one that has it take ~2 s. (No UCX, gRPC or threads in the server.)
        self.ctx_mp = mp.get_context("forkserver")
        self.ctx_mp.set_forkserver_preload(["torch", "helixserve.engine.llm", "helixserve.parallel"])
        self.results = self.ctx_mp.Queue()
        self.inboxes = {name: self.ctx_mp.Queue() for name in ("ctx", "gen0", "gen1", "gen2", "gen3")}
        init = f"tcp://127.0.0.1:{free_port()}"
        self.procs = {"ctx": self.ctx_mp.Process(target=_ctx_main, args=(checkpoints, self.inboxes["ctx"], self.results))}
        for rank in range(4):
            self.procs[f"gen{rank}"] = self.ctx_mp.Process(
                target=_gen_main, args=(rank, init, checkpoints, self.inboxes[f"gen{rank}"], self.results))
        for proc in self.procs.values():
            proc.start()
        self.stash: dict = {}
        self.tags = count()
        ready = self.wait([(name, "ready") for name in self.procs], timeout_s=90.0)
        self.endpoints = ready[("ctx", "ready")]

    def ask(self, targets: list[str], cmd: str, *args, timeout_s: float = WAIT_S) -> list:
        tag = next(self.tags)
        for name in targets:
            self.inboxes[name].put((tag, cmd, args))
        got = self.wait([(name, tag) for name in targets], timeout_s)
        return [got[(name, tag)] for name in targets]

    def params(self, model: str, rid: str, first: int, prompt=PROMPT, endpoint=None) -> str:
        ep, layout = self.endpoints[model]
        return DisaggregatedParams(request_type="generation_only", ctx_request_id=rid, first_gen_tokens=[first],
                                   prompt_token_ids=prompt, ctx_endpoint=endpoint or ep, layout=layout).model_dump_json()

    def prefill(self, model: str, rid: str, prompt=PROMPT, hold_timeout_s: float | None = None):
        return self.ask(["ctx"], "prefill", model, rid, prompt, hold_timeout_s)[0]



@pytest.fixture(scope="module")
def world(tiny_checkpoints):
    w = World(tiny_checkpoints)
    yield w
    w.close()


def _shard(state: dict, cp_rank: int, cp_size: int, num_heads: int) -> dict:
    """The oracle: slice the ctx's whole request state the way the layout says."""
    h0, h1 = cp_rank * num_heads // cp_size, (cp_rank + 1) * num_heads // cp_size

    def conv(full):
        k = full.shape[0] // (3 * num_heads)
        return torch.cat([full[s * num_heads * k + h0 * k: s * num_heads * k + h1 * k] for s in range(3)])
    return {"mla": {i: t[cp_rank::cp_size] for i, t in state["mla"].items()},
            "kda": {i: t[h0:h1] for i, t in state["kda"].items()},
            "conv": {i: conv(t) for i, t in state["conv"].items()}}


def _assert_bytes_equal(got: dict, want: dict) -> None:
    for part in ("mla", "kda", "conv"):
        assert got[part].keys() == want[part].keys(), part
        for layer, tensor in want[part].items():
            a, b = got[part][layer].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)
            assert a.shape == b.shape and torch.equal(a, b), (part, layer)


def _ctx_settled(world: World, model: str, rid: str, timeout_s: float = 5.0):
    end = time.monotonic() + timeout_s
    while True:
        engine_stats, sender_stats, released = world.ask(["ctx"], "stats", model)[0]
        if rid in released or time.monotonic() > end:
            return engine_stats, sender_stats, released
        time.sleep(0.02)


@pytest.mark.parametrize("model", MODELS)
def test_cp2_each_rank_gets_its_shard_byte_for_byte_and_ctx_frees(world, model):
    heads = world.endpoints[model][1]["num_kda_heads"]
    first, state = world.prefill(model, f"{model}-a")
    params = world.params(model, f"{model}-a", first)
    got = world.ask(["gen0", "gen1"], "receive", model, "g-a", params, None)
    for cp_rank, result in enumerate(got):
        assert "error" not in result, result.get("error")
        _assert_bytes_equal(result["state"], _shard(state, cp_rank, 2, heads))
        assert result["leaked"] == (0, 0)
    _, sender_stats, released = _ctx_settled(world, model, f"{model}-a")
    assert f"{model}-a" in released and sender_stats.num_quarantined == 0


def test_dp2_cp2_two_requests_on_two_groups_at_once(world):
    model = "kimi-k3-tiny"
    heads = world.endpoints[model][1]["num_kda_heads"]
    first_a, state_a = world.prefill(model, "dp-a")
    first_b, state_b = world.prefill(model, "dp-b", prompt=PROMPT[:13])
    params = {"a": world.params(model, "dp-a", first_a), "b": world.params(model, "dp-b", first_b, PROMPT[:13])}
    tag = next(world.tags)
    for rank, key in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
        world.inboxes[f"gen{rank}"].put((tag, "receive", (model, f"g-{key}", params[key], None)))
    got = world.wait([(f"gen{rank}", tag) for rank in range(4)])
    for rank, (state, cp_rank) in enumerate(((state_a, 0), (state_a, 1), (state_b, 0), (state_b, 1))):
        result = got[(f"gen{rank}", tag)]
        assert "error" not in result, result.get("error")
        _assert_bytes_equal(result["state"], _shard(state, cp_rank, 2, heads))


@pytest.mark.parametrize("model", MODELS)
def test_cp1_decode_from_received_state_equals_single_process(world, model):
    first, _ = world.prefill(model, f"{model}-d")
    out = world.ask(["gen0"], "decode", model, "g-d", world.params(model, f"{model}-d", first), 8)[0]
    assert out["disagg"][0] == first and len(out["disagg"]) == 8
    assert out["disagg"] == out["agg"]
    assert out["used"] == 0


def test_killed_ctx_fails_the_request_on_every_rank_before_the_timeout(world):
    commands, results = world.ctx_mp.Queue(), world.ctx_mp.Queue()
    victim = world.ctx_mp.Process(target=_victim_main, args=(commands, results))
    victim.start()
    try:
        _, (endpoint, pid) = results.get(timeout=WAIT_S)[1:]
        params = world.params("kimi-k3-tiny", "doomed", 5, endpoint=endpoint)
        tag = next(world.tags)
        for rank in (0, 1):
            world.inboxes[f"gen{rank}"].put((tag, "receive", ("kimi-k3-tiny", "g-doomed", params, None)))
        time.sleep(0.5)  # the transfer started: two messages per rank landed, then silence
        os.kill(pid, signal.SIGKILL)
        got = world.wait([("gen0", tag), ("gen1", tag)])
    finally:
        victim.join(timeout=10)
        if victim.is_alive():
            victim.kill()
    errors = [got[(f"gen{r}", tag)]["error"] for r in (0, 1)]
    assert errors[0] == errors[1]  # one agreed error on every rank
    assert f"ctx worker {endpoint['host']}:{endpoint['port']} went away" in errors[0]
    for r in (0, 1):
        result = got[(f"gen{r}", tag)]
        assert result["elapsed"] < GEN_TIMEOUT_MS / 1000  # its control connection closed: no wait
        assert result["leaked"] == (0, 0)


def test_one_stalled_rank_completes_nowhere_then_fails_everywhere(world):
    model = "kimi-k3-tiny"
    first, _ = world.prefill(model, "half")
    world.ask(["ctx"], "stall", 1, 1)  # only cp_rank 1's stream goes quiet
    try:
        got = world.ask(["gen0", "gen1"], "receive", model, "g-half", world.params(model, "half", first), None)
    finally:
        world.ask(["ctx"], "stall", None)
    assert all("state" not in r for r in got)  # rank 0 had everything, yet did not start
    assert got[0]["error"] == got[1]["error"] and "to gen rank 1 failed" in got[0]["error"]
    assert all(r["leaked"] == (0, 0) for r in got)
    _, sender_stats, released = _ctx_settled(world, model, "half")
    assert "half" in released and sender_stats.num_quarantined == 0


def test_cancel_mid_transfer_frees_both_sides(world):
    model = "kimi-linear-tiny"
    first, _ = world.prefill(model, "cancel-me")
    world.ask(["ctx"], "stall", 3)
    try:
        got = world.ask(["gen0", "gen1"], "receive", model, "g-c", world.params(model, "cancel-me", first), 3)
    finally:
        world.ask(["ctx"], "stall", None)
    assert all(r["cancelled"] and "error" not in r and "state" not in r for r in got), got
    assert all(r["leaked"] == (0, 0) for r in got)
    engine_stats, sender_stats, released = _ctx_settled(world, model, "cancel-me")
    assert "cancel-me" in released and sender_stats.num_quarantined == 0 and engine_stats.num_held == 0


def test_layout_mismatch_is_a_clear_error_at_the_first_request_and_leaks_nothing(world):
    model = "kimi-k3-tiny"
    first, _ = world.prefill(model, "lay")
    params = DisaggregatedParams.model_validate_json(world.params(model, "lay", first))
    bad = params.model_copy(update={"layout": params.layout.model_copy(update={"kv_lora_rank": 64})})
    got = world.ask(["gen0", "gen1"], "receive", model, "g-lay", bad.model_dump_json(), None)
    assert all("kv_lora_rank: 32 != 64" in r["error"] and r["leaked"] == (0, 0) for r in got)
    # the ctx side checks the receiver's layout too, and keeps the hold for a correct request
    client = ControlClient(params.ctx_endpoint, timeout_s=2.0)
    reply = client.request_shard(pb.ShardRequest(
        ctx_request_id="lay", cp_size=1, num_prompt_tokens=len(PROMPT), max_message_bytes=1024,
        layout_json=params.layout.model_copy(update={"tokens_per_block": 8}).model_dump_json(),
        ucx_worker_address=b"\0" * 64))
    client.close()
    assert not reply.accepted and "tokens_per_block: 4 != 8" in reply.error
    got = world.ask(["gen0", "gen1"], "receive", model, "g-lay", params.model_dump_json(), None)
    assert all("state" in r for r in got)


def test_hold_deadline_frees_and_counts_expired(world):
    model = "kimi-linear-tiny"
    _, before, _ = world.ask(["ctx"], "stats", model)[0]
    world.prefill(model, "forgotten", hold_timeout_s=0.3)
    engine_stats, sender_stats, released = _ctx_settled(world, model, "forgotten")
    assert "forgotten" in released and engine_stats.num_held == 0
    assert sender_stats.metrics.expired_holds == before.metrics.expired_holds + 1
