"""A ctx world's holds over a real gloo group of 2 ranks, each its real KV sender (UCX, gRPC) built
by the world's factory on ``port + rank``: a hold is released only once every rank freed it
(cancelled on both, or its deadline passed on both), every rank learns the same ids at the same
agreement, and a hold one rank could not take is cancelled on the other at the next agreement; the
group's transfer counters count each hold once."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.cache_layout import cache_spec_for  # noqa: E402
from helixserve.config_transceiver import TransceiverConfig  # noqa: E402
from helixserve.ctx_server.world_transfer import WorldSenderFactory  # noqa: E402
from helixserve.engine.kv_holds import HoldStart, RankHolds  # noqa: E402
from helixserve.kvcache.manager import CacheManager  # noqa: E402
from helixserve.kvcache.pools import allocate_model_caches  # noqa: E402
from helixserve.launch.processes import run_local_world  # noqa: E402
from helixserve.models.presets import get_preset  # noqa: E402
from helixserve.parallel import Mapping, init_parallel  # noqa: E402
from helixserve.parallel.ports import free_ports  # noqa: E402

CFG = get_preset("kimi-k3-tiny")
TPB = 4
TP = 2
HOLD_S = 3.0  # longer than the refused and cancelled agreements take
AGREE_LIMIT_S = 15.0


def _agree_until(holds: RankHolds, request_id: str) -> tuple[list[list[str]], float]:
    """Agree (every rank the same number of times: until both ranks saw `request_id` freed)."""
    began, seen = time.monotonic(), []
    while time.monotonic() - began < AGREE_LIMIT_S:
        seen.append(holds.agree())
        if request_id in seen[-1]:
            return seen, time.monotonic() - began
        time.sleep(0.05)
    raise AssertionError(f"{request_id} not freed on every rank within {AGREE_LIMIT_S} s: {seen}")


def _rank(rank: int, world_size: int, init_method: str, port: int) -> dict:
    groups = init_parallel(Mapping(world_size, rank, dp=1, cp=world_size), init_method, backend="gloo", timeout_s=30)
    config = TransceiverConfig(kv_transfer_timeout_ms=5000, rpc_timeout_ms=1000, drain_timeout_ms=500)
    factory = WorldSenderFactory(config, "kimi-k3-tiny", "dummy", "kimi-k3-tiny", "float32", TP, "127.0.0.1",
                                 port, HOLD_S)
    caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB, kda_num_heads=CFG.kda_num_heads // TP),
                                   32, 4)
    sender = factory(groups.mapping, caches)
    holds = RankHolds(sender, groups.cp_cpu, world_size)
    manager = CacheManager(32, 4, TPB, rank, TP)
    out: dict = {"endpoint": (sender.endpoint.host, sender.endpoint.port),
                 "layout": (sender.sender.layout.ctx_tp_size, sender.sender.layout.ctx_rank)}
    try:
        for rid in ("cancelled", "expires"):
            holds.hold(HoldStart(rid, manager.allocate(rid, 9), 9, (7,)))
        # rank 1 is handed another rank's handle: it cannot hold it (nothing of it served there)
        wrong = CacheManager(32, 4, TPB, 0, TP).allocate("refused", 9) if rank == 1 else manager.allocate("refused", 9)
        holds.hold(HoldStart("refused", wrong, 9, (7,)))
        out["refused"] = _agree_until(holds, "refused")[0][-1]
        holds.cancel("cancelled", "the client went away")
        out["cancelled"] = _agree_until(holds, "cancelled")[0][-1]
        out["expired"] = _agree_until(holds, "expires")[0][-1]
        out["num_held"] = holds.num_held
        m = holds.world_metrics
        out["metrics"] = (m.completed, m.cancellations, m.timeouts, m.failures)
        return out
    finally:
        holds.close()
        groups.destroy()


def test_holds_are_released_once_every_rank_freed_them() -> None:
    port = free_ports(1)[0]
    results = run_local_world(_rank, TP, port, timeout_s=120)
    assert [r["endpoint"] for r in results] == [("127.0.0.1", port + r) for r in range(TP)]
    assert [r["layout"] for r in results] == [(TP, r) for r in range(TP)]
    for key in ("refused", "cancelled", "expired"):  # every rank: the same ids at the same agreement
        assert results[0][key] == results[1][key], (key, results)
    assert results[0]["refused"] == ["refused"]  # cancelled on rank 0 at once; the others still held
    assert results[0]["cancelled"] == ["cancelled"]
    assert results[0]["expired"] == ["expires"] and [r["num_held"] for r in results] == [0, 0]
    # the group's counters count a hold once: "refused" and "cancelled" cancelled (rank 0 held both,
    # rank 1 only "cancelled"), "expires" timed out on both; every rank agrees on them
    assert results[0]["metrics"] == results[1]["metrics"] == (0, 2, 1, 1), results
