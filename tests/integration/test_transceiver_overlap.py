"""Many overlapping transfers between the SAME pair of workers, over REAL UCX and gRPC.

One ctx process (a KVSender over a random-filled kimi-k3-tiny cache) and one gen process holding
two KVReceivers (cp_rank 0 and 1 of a CP group of 2: two UCX workers, both fetching every request
from the one ctx worker). 32 requests of 1..63 tokens run at once: short ones finish (and are
forgotten) while long ones are still moving, some are aborted by gen mid-transfer, some by the
ctx, and one has a receive that fails mid-transfer (the ctx sends a message longer than the posted
receive: a real UCX truncation error). Checked: every other request arrives byte for byte on
both ranks, failures name their cause, and afterwards nothing is held on either side (blocks,
slots, holds, transfers, sinks). The gen process frees like the engine does: on completion, and
after `cancel()` returned for a failed or aborted transfer (rank failures are shared by both
ranks, as the CP consensus does). Every wait is bounded.

(With one UCX endpoint per request, closing one request's endpoint cancelled another's receives:
"UCXXCanceledError: Request canceled" under load, then KV blocks left held.)
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.protocol.disagg import DisaggregatedParams  # noqa: E402
from tests.integration.test_transceiver_transfer import (  # noqa: E402
    Mailbox, _assert_bytes_equal, _exit, _quiet, _shard,
)

TPB = 4
NUM_BLOCKS, NUM_SLOTS = 512, 48
MESSAGE_BYTES = 12288  # ~7 messages per shard; large enough for UCX rendezvous on shared memory
GEN_TIMEOUT_MS = 3000
WAIT_S = 60.0
NUM_REQUESTS = 32
FIRST = [5]


def _gen_config():
    from helixserve.config_transceiver import TransceiverConfig

    return TransceiverConfig(kv_transfer_timeout_ms=GEN_TIMEOUT_MS, message_bytes=MESSAGE_BYTES,
                             rpc_timeout_ms=2000, drain_timeout_ms=1000)


def _layout_and_spec(cp_size: int = 1):
    from helixserve.cache_layout import cache_spec_for
    from helixserve.models.presets import get_preset
    from helixserve.transceiver.layout import layout_for

    cfg = get_preset("kimi-k3-tiny")
    return (layout_for(cfg, torch.float32, TPB, "kimi-k3-tiny"),
            cache_spec_for(cfg, torch.float32, TPB, cfg.kda_num_heads // cp_size))


def _fault(ctx_request_id: str, kind: str, index: int) -> None:
    """In the ctx, for `ctx_request_id`: "stall": post nothing from message `index` on (the gen
    aborts it mid-transfer); "oversize": message `index` goes out 64 bytes longer than planned,
    so the gen's receive of it fails (UCX message truncated) while the transfer is in flight."""
    from helixserve.transceiver.layout import wire_tag
    from helixserve.transceiver.ctx.outbound import Outbound

    original = Outbound._post

    def post(self, plane, i):
        if self.request_id != ctx_request_id or i < index or (kind == "oversize" and i > index):
            return original(self, plane, i)
        if kind == "stall":
            return False
        buffer = torch.zeros(self.plan.messages[i].nbytes + 64, dtype=torch.uint8)
        self.sent[i].handle = plane.send_message(self.peer, wire_tag(self.tag_base, i), buffer)
        self.sent[i].staging = None
        self._oversized = buffer  # kept alive while UCX reads it
        return True

    Outbound._post = post


def _ctx_main(commands, results) -> None:
    _quiet()
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.kvcache.manager import CacheManager
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.transceiver.ctx.sender import KVSender

    layout, spec = _layout_and_spec()
    caches = allocate_model_caches(spec, NUM_BLOCKS, NUM_SLOTS)
    generator = torch.Generator().manual_seed(0)
    for pools in (caches.mla_kv, caches.kda_state, caches.conv_state):
        for pool in pools.values():
            pool.copy_(torch.rand(pool.shape, generator=generator))
    manager = CacheManager(NUM_BLOCKS, NUM_SLOTS, TPB)
    freed: queue.SimpleQueue = queue.SimpleQueue()  # sender thread -> this thread
    sender = KVSender(TransceiverConfig(kv_transfer_timeout_ms=20000), layout, caches, freed.put)
    endpoint = sender.start()
    results.put(("ctx", "ready", (endpoint.model_dump(), layout.model_dump())))
    released: list[str] = []
    while True:
        while not freed.empty():
            rid = freed.get()
            manager.free(rid)
            released.append(rid)
        try:
            tag, cmd, args = commands.get(timeout=0.005)
        except queue.Empty:
            continue
        if cmd == "stop":
            break
        if cmd == "hold":
            states = {}
            for rid, num_tokens in args[0]:
                handle = manager.allocate(rid, num_tokens)
                sender.hold(rid, handle, num_tokens, FIRST)
                nb = handle.num_logical_blocks
                states[rid] = {"mla": {i: p[handle.block_ids[:nb]].clone() for i, p in caches.mla_kv.items()},
                               "kda": {i: p[handle.slot].clone() for i, p in caches.kda_state.items()},
                               "conv": {i: p[handle.slot].clone() for i, p in caches.conv_state.items()}}
            results.put(("ctx", tag, states))
        elif cmd == "fault":
            _fault(*args)
            results.put(("ctx", tag, None))
        elif cmd == "cancel":
            results.put(("ctx", tag, sender.cancel(args[0], "the ctx client went away")))
        elif cmd == "stats":
            s, m = sender.stats(), manager.stats()
            results.put(("ctx", tag, {"held": s.num_held, "quarantined": s.num_quarantined,
                                      "used_blocks": m.num_used_blocks, "used_slots": m.num_used_slots,
                                      "released": list(released)}))
    sender.stop()
    _exit(results)


# ---------------------------------------------------------------------------------- gen side

class _Rank:
    """One gen CP rank: a KVReceiver over its own pools, freed like the engine frees."""

    def __init__(self, cp_rank: int) -> None:
        from helixserve.kvcache.manager import CacheManager
        from helixserve.kvcache.pools import allocate_model_caches
        from helixserve.transceiver.gen.receiver import KVReceiver

        layout, spec = _layout_and_spec(cp_size=2)
        self.cp_rank = cp_rank
        self.manager = CacheManager(NUM_BLOCKS, NUM_SLOTS, TPB, cp_rank, 2)
        self.manager.allocate("padding", 7 + 5 * cp_rank)  # block ids differ from the ctx's
        self.caches = allocate_model_caches(spec, NUM_BLOCKS, NUM_SLOTS)
        self.rx = KVReceiver(_gen_config(), layout, cp_rank=cp_rank, cp_size=2, gen_rank=cp_rank)

    def state(self, rid: str) -> dict:
        handle = self.manager.get(rid)
        return {"mla": {i: p[handle.block_ids].clone() for i, p in self.caches.mla_kv.items()},
                "kda": {i: p[handle.slot].clone() for i, p in self.caches.kda_state.items()},
                "conv": {i: p[handle.slot].clone() for i, p in self.caches.conv_state.items()}}

    def drop(self, rid: str) -> None:
        """Stop the transfer (bounded; returns once nothing can write), then free its blocks."""
        self.rx.cancel(rid)
        self.manager.free(rid)


def _receive_all(ranks: list[_Rank], requests: list[tuple[str, str, int | None]]) -> dict:
    """Start every request on every rank at once; abort those with an abort point once rank 0
    landed that many of their messages; collect bytes / errors; everything freed at the end."""
    out: dict = {rid: {"state": {}, "error": None} for rid, _, _ in requests}
    aborts = {rid: after for rid, _, after in requests if after is not None}
    live = {(r.cp_rank, rid) for r in ranks for rid, _, _ in requests}
    for rid, params_json, _ in requests:
        for rank in ranks:
            rank.rx.start(rid, rank.manager.allocate(rid, len(DisaggregatedParams.model_validate_json(
                params_json).prompt_token_ids)), rank.caches, DisaggregatedParams.model_validate_json(params_json))

    def end(rid: str, error: str) -> None:  # one rank failed: the group fails it everywhere
        out[rid]["error"] = out[rid]["error"] or error
        for rank in ranks:
            if (rank.cp_rank, rid) in live:
                live.discard((rank.cp_rank, rid))
                rank.drop(rid)

    deadline = time.monotonic() + WAIT_S
    while live and time.monotonic() < deadline:
        for rid, after in list(aborts.items()):
            inbound = ranks[0].rx.inbounds.get(rid)
            if inbound is not None and sum(r.is_done for r in inbound.transport.recvs) >= after:
                del aborts[rid]
                end(rid, "aborted by the gen client")
        for rank in ranks:
            for rid, error in rank.rx.poll(wait_num=1, interval_s=0.002).items():
                if (rank.cp_rank, rid) not in live:
                    continue
                if error is not None:
                    end(rid, error)
                    continue
                live.discard((rank.cp_rank, rid))
                if out[rid]["error"] is None:
                    out[rid]["state"][rank.cp_rank] = rank.state(rid)
                rank.manager.free(rid)
    for rank in ranks:  # sinks and retractions end within their bounds
        end_by = time.monotonic() + 5.0
        while (rank.rx.retractor.sinks or rank.rx.inbounds) and time.monotonic() < end_by:
            rank.rx.progress()
            time.sleep(0.005)
    leftovers = {r.cp_rank: {"used_blocks": r.manager.stats().num_used_blocks - 1,  # "padding"
                             "used_slots": r.manager.stats().num_used_slots - 1,
                             "inbounds": sorted(r.rx.inbounds), "sessions": sorted(r.rx.poller.sessions),
                             "sinks": len(r.rx.retractor.sinks)} for r in ranks}
    return {"requests": out, "still_live": sorted(live), "leftovers": leftovers}


def _gen_main(commands, results) -> None:
    _quiet()
    ranks = [_Rank(0), _Rank(1)]
    results.put(("gen", "ready", None))
    while True:
        tag, cmd, args = commands.get(timeout=WAIT_S * 4)
        if cmd == "stop":
            break
        if cmd == "receive":
            results.put(("gen", tag, _receive_all(ranks, args[0])))
    for rank in ranks:
        rank.rx.close()
    _exit(results)


# ---------------------------------------------------------------------------------- test side

class Pair(Mailbox):
    def __init__(self) -> None:
        self.mp = mp.get_context("forkserver")
        self.mp.set_forkserver_preload(["torch", "helixserve.kvcache.pools"])
        self.results = self.mp.Queue()
        self.inboxes = {"ctx": self.mp.Queue(), "gen": self.mp.Queue()}
        self.procs = {"ctx": self.mp.Process(target=_ctx_main, args=(self.inboxes["ctx"], self.results)),
                      "gen": self.mp.Process(target=_gen_main, args=(self.inboxes["gen"], self.results))}
        for proc in self.procs.values():
            proc.start()
        self.stash: dict = {}
        self.tag = 0
        ready = self.wait([("ctx", "ready"), ("gen", "ready")], 90.0)
        self.endpoint, self.layout = ready[("ctx", "ready")]

    def ask(self, name: str, cmd: str, *args, timeout_s: float = WAIT_S):
        self.tag += 1
        self.inboxes[name].put((self.tag, cmd, args))
        return self.wait([(name, self.tag)], timeout_s)[(name, self.tag)]

    def params(self, rid: str, num_tokens: int) -> str:
        return DisaggregatedParams(request_type="generation_only", ctx_request_id=rid, first_gen_tokens=FIRST,
                                   prompt_token_ids=list(range(1, num_tokens + 1)), ctx_endpoint=self.endpoint,
                                   layout=self.layout).model_dump_json()

    def ctx_idle(self, timeout_s: float = 15.0) -> dict:
        end = time.monotonic() + timeout_s
        while True:
            stats = self.ask("ctx", "stats")
            if (stats["held"] == stats["used_blocks"] == stats["used_slots"] == 0) or time.monotonic() > end:
                return stats
            time.sleep(0.05)



@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


def _assert_nothing_held(pair: Pair, result: dict) -> None:
    assert result["still_live"] == [], result["still_live"]
    for cp_rank, left in result["leftovers"].items():
        assert left == {"used_blocks": 0, "used_slots": 0, "inbounds": [], "sessions": [], "sinks": 0}, (cp_rank, left)
    stats = pair.ctx_idle()
    assert stats["held"] == stats["quarantined"] == stats["used_blocks"] == stats["used_slots"] == 0, stats


def _run(pair: Pair, prefix: str, plan: list[tuple[int, int | None]]) -> tuple[dict, dict]:
    """Hold `plan`'s requests (tokens, gen abort point) on the ctx, receive them all at once."""
    rids = [f"{prefix}-{i}" for i in range(len(plan))]
    states = pair.ask("ctx", "hold", [(rid, n) for rid, (n, _) in zip(rids, plan)])
    requests = [(rid, pair.params(rid, n), after) for rid, (n, after) in zip(rids, plan)]
    return states, requests


def test_32_overlapping_transfers_between_one_pair_of_workers_arrive_exactly_and_free_all(pair):
    heads = pair.layout["num_kda_heads"]
    plan = [(1 + (i * 13) % 63, None) for i in range(NUM_REQUESTS)]
    plan[3] = (plan[3][0], 1)  # aborted by gen after rank 0 landed one message (the ctx stalls)
    plan[17] = (plan[17][0], 2)
    states, requests = _run(pair, "ov", plan)
    pair.ask("ctx", "fault", "ov-3", "stall", 1)
    pair.ask("ctx", "fault", "ov-17", "stall", 2)
    assert pair.ask("ctx", "cancel", "ov-9")  # the ctx gives one up before gen asks for it
    pair.inboxes["gen"].put((pair.tag + 1, "receive", (requests,)))
    pair.tag += 1
    result = pair.wait([("gen", pair.tag)], WAIT_S + 30)[("gen", pair.tag)]
    for rid, got in result["requests"].items():
        if rid in ("ov-3", "ov-17", "ov-9"):
            assert got["error"], rid
            continue
        assert got["error"] is None, (rid, got["error"])
        assert sorted(got["state"]) == [0, 1], rid
        for cp_rank, state in got["state"].items():
            _assert_bytes_equal(state, _shard(states[rid], cp_rank, 2, heads))
    assert "not held here" in result["requests"]["ov-9"]["error"]
    _assert_nothing_held(pair, result)


def test_a_receive_failing_mid_transfer_fails_that_request_and_frees_everything(pair):
    heads = pair.layout["num_kda_heads"]
    plan = [(40 + i, None) for i in range(8)]
    states, requests = _run(pair, "fx", plan)
    pair.ask("ctx", "fault", "fx-2", "oversize", 1)  # its message 1 overruns the posted receive
    pair.inboxes["gen"].put((pair.tag + 1, "receive", (requests,)))
    pair.tag += 1
    result = pair.wait([("gen", pair.tag)], WAIT_S + 30)[("gen", pair.tag)]
    error = result["requests"]["fx-2"]["error"]
    assert error and "message 1" in error and "UCX" in error, error
    for rid, got in result["requests"].items():
        if rid == "fx-2":
            continue
        assert got["error"] is None, (rid, got["error"])
        for cp_rank, state in got["state"].items():
            _assert_bytes_equal(state, _shard(states[rid], cp_rank, 2, heads))
    _assert_nothing_held(pair, result)
