"""The ctx and gen ends the transceiver's in-process tests share (no model: seeded random cache
contents; the oracle slices the ctx tensors directly). Test files add their receiver on top of
:class:`GenPools`: a plain ``KVReceiver``, or :class:`RankReception`, a gen world rank's
receptions through the servers' own ``RankTransfers`` and ``TransferConsensus``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helixserve.cache_layout import ModelCaches, cache_spec_for
from helixserve.config_transceiver import TransceiverConfig
from helixserve.engine.kv_intake import RankTransfers
from helixserve.gen_server.kv_source import PacedKVReceiver
from helixserve.kvcache.manager import CacheHandle, CacheManager
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol.disagg import DisaggregatedParams, TransceiverEndpoint
from helixserve.transceiver.consensus import TransferConsensus
from helixserve.transceiver.layout import layout_for
from helixserve.transceiver.ctx.sender import KVSender
from helixserve.transceiver.gen.receiver import KVReceiver
from helixserve.transceiver.ticket import KVTicket

CFG = get_preset("kimi-k3-tiny")
TPB = 4
LAYOUT = layout_for(CFG, torch.float32, TPB, "kimi-k3-tiny")
H, K = CFG.kda_num_heads, CFG.kda_head_dim
NUM_TOKENS = 23  # 6 blocks, the last one partial


def conv_heads(conv: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """Heads ``[h0, h1)`` of each ``q | k | v`` section of a full-head ``[3*H*K, W-1]`` conv state."""
    return torch.cat([conv[s * H * K + h0 * K: s * H * K + h1 * K] for s in range(3)])


class Ctx:
    """A ctx worker without a model: seeded random cache contents, the real KVSender."""

    def __init__(self, cfg: TransceiverConfig) -> None:
        torch.manual_seed(0)
        self.caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB), 32, 4)
        for pools in (self.caches.mla_kv, self.caches.kda_state, self.caches.conv_state):
            for pool in pools.values():
                pool.copy_(torch.randn(pool.shape))
        self.manager = CacheManager(32, 4, TPB)
        self.manager.allocate("other", 9)  # the held request's blocks do not start at 0
        self.freed: list[str] = []
        self.sender = KVSender(cfg, LAYOUT, self.caches, self.freed.append)
        self.endpoint = self.sender.start()

    def hold(self, request_id: str, num_tokens: int = NUM_TOKENS, **kwargs) -> DisaggregatedParams:
        handle = self.manager.allocate(request_id, num_tokens)
        self.sender.hold(request_id, handle, num_tokens, [7], **kwargs)
        return DisaggregatedParams(request_type="generation_only", ctx_request_id=request_id,
                                   first_gen_tokens=[7], prompt_token_ids=list(range(1, num_tokens + 1)),
                                   ctx_endpoint=self.endpoint, layout=LAYOUT)

    def expected_shard(self, request_id: str, cp_rank: int, cp_size: int) -> dict:
        handle, c = self.manager.get(request_id), self.caches
        h0, h1 = cp_rank * H // cp_size, (cp_rank + 1) * H // cp_size
        blocks = [handle.block_ids[b] for b in range(cp_rank, len(handle.block_ids), cp_size)]
        return {
            "mla": {i: c.mla_kv[i][blocks] for i in c.mla_kv},
            "kda": {i: c.kda_state[i][handle.slot, h0:h1] for i in c.kda_state},
            "conv": {i: conv_heads(c.conv_state[i][handle.slot], h0, h1) for i in c.conv_state},
        }

    def close(self) -> None:
        self.sender.stop()


@dataclass(slots=True)
class CtxRank:
    caches: ModelCaches
    manager: CacheManager
    sender: KVSender
    endpoint: TransceiverEndpoint
    freed: list[str]


class CtxWorld:
    """A ctx world of `tp` ranks without a model: rank s holds, in pools of ``H/tp`` heads and a
    cache manager of its own (cp_rank s of tp), the part of `full`'s cache (a :class:`Ctx`: the
    single-process prefill) its rank would hold -- blocks ``b % tp == s``, heads ``[s*H/tp, ..)`` --
    and serves it with its real KVSender."""

    def __init__(self, full: Ctx, cfg: TransceiverConfig, tp: int) -> None:
        self.full, self.tp = full, tp
        self.layout = LAYOUT.model_copy(update={"ctx_tp_size": tp})
        self.ranks: list[CtxRank] = []
        for s in range(tp):
            caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB, kda_num_heads=H // tp), 32, 4)
            manager = CacheManager(32, 4, TPB, s, tp)
            manager.allocate("other", (3 + s) * tp * TPB)  # its blocks do not start at 0
            freed: list[str] = []
            sender = KVSender(cfg, self.layout.model_copy(update={"ctx_rank": s}), caches, freed.append)
            self.ranks.append(CtxRank(caches, manager, sender, sender.start(), freed))

    def hold(self, request_id: str, num_tokens: int) -> KVTicket:
        """Prefill `request_id` in `full`'s cache (not held there), deal it to the ranks, hold it on each."""
        src, c = self.full.manager.allocate(request_id, num_tokens), self.full.caches
        for s, rank in enumerate(self.ranks):
            handle = rank.manager.allocate(request_id, num_tokens)
            h0, h1 = s * H // self.tp, (s + 1) * H // self.tp
            mine = [src.block_ids[b] for b in range(s, len(src.block_ids), self.tp)]
            for i, pool in rank.caches.mla_kv.items():
                pool[handle.block_ids] = c.mla_kv[i][mine]
            for i, pool in rank.caches.kda_state.items():
                pool[handle.slot] = c.kda_state[i][src.slot, h0:h1]
            for i, pool in rank.caches.conv_state.items():
                pool[handle.slot] = conv_heads(c.conv_state[i][src.slot], h0, h1)
            rank.sender.hold(request_id, handle, num_tokens, [7])
        return KVTicket(request_id, self.ranks[0].endpoint, self.layout, num_tokens, (7,),
                        ctx_endpoints=tuple(rank.endpoint for rank in self.ranks))

    def close(self) -> None:
        for rank in self.ranks:
            rank.sender.stop()


class GenPools:
    """One gen rank's pools (H / cp heads) with fragmented blocks: a hole, so this rank's blocks
    are not consecutive."""

    def __init__(self, cp_rank: int = 0, cp_size: int = 1) -> None:
        spec = cache_spec_for(CFG, torch.float32, TPB, kda_num_heads=H // cp_size)
        self.caches = allocate_model_caches(spec, 32, 4)
        self.manager = CacheManager(32, 4, TPB, cp_rank, cp_size)
        for name in ("a", "b", "c"):
            self.manager.allocate(name, 4 * cp_size)
        self.manager.free("b")

    def received(self, request_id: str) -> dict:
        handle, c = self.manager.get(request_id), self.caches
        return {"mla": {i: c.mla_kv[i][handle.block_ids] for i in c.mla_kv},
                "kda": {i: c.kda_state[i][handle.slot] for i in c.kda_state},
                "conv": {i: c.conv_state[i][handle.slot] for i in c.conv_state}}

    def used(self) -> tuple[int, int]:
        stats = self.manager.stats()
        return stats.num_used_blocks, stats.num_used_slots


@dataclass(slots=True)
class Agreed:
    """One :meth:`RankReception.check`: identical on every rank of the group."""

    ready: list[str] = field(default_factory=list)  # received on every rank: may start decoding
    failed: dict[str, str] = field(default_factory=dict)  # failed on some rank -> the first cause
    freed: list[str] = field(default_factory=list)  # failed, cancelled or aborted: blocks freed here


class RankReception:
    """One gen rank's receptions as a gen world runs them, without the engine: the blocks and
    slot allocated in this rank's cache manager (the leader's ``KVIntake`` does it for every
    rank), the transfer started and agreed on through :class:`RankTransfers` over the gen
    server's :class:`PacedKVReceiver` and the CP group's :class:`TransferConsensus` (local
    without one). Every rank of a group calls :meth:`check` the same number of times."""

    def __init__(self, receiver: KVReceiver, manager: CacheManager, caches: ModelCaches,
                 consensus: TransferConsensus | None = None) -> None:
        self.receiver, self.cache_manager, self.caches = receiver, manager, caches
        paced = PacedKVReceiver(receiver, receiver.config.poll_interval_s)
        self.transfers = RankTransfers(paced, caches, consensus or TransferConsensus(is_local=True))
        self._started: dict[str, DisaggregatedParams | KVTicket] = {}
        self._freed: list[str] = []

    def begin(self, request_id: str, params: DisaggregatedParams | KVTicket) -> CacheHandle:
        ticket = KVTicket.from_params(params) if isinstance(params, DisaggregatedParams) else params
        handle = self.cache_manager.allocate(request_id, ticket.num_prompt_tokens)
        self._started[request_id] = params
        self.transfers.start(request_id, handle, ticket)  # as the gen server does
        return handle

    def check(self) -> Agreed:
        """One poll and one agreement; an agreed failure is cancelled here and its blocks freed."""
        agreed = self.transfers.agree()
        out = Agreed()
        for request_id in sorted((agreed.failed | agreed.cancelled) & self._started.keys()):
            out.failed[request_id] = agreed.errors.get(request_id) or f"request {request_id}: KV transfer failed"
            self._free(request_id)
        out.ready = [rid for rid in sorted(agreed.ready) if self._started.pop(rid, None) is not None]
        out.freed, self._freed = self._freed, []
        return out

    def cancel(self, request_id: str) -> bool:
        """The client went away: what the leader's abort does on this rank (the reception stops,
        then its blocks are freed)."""
        if request_id not in self._started:
            return False
        self.transfers.cancel(request_id)
        self._free(request_id)
        return True

    def _free(self, request_id: str) -> None:
        del self._started[request_id]
        self.cache_manager.free(request_id)
        self._freed.append(request_id)

    def close(self) -> None:
        self.receiver.close()


def drive(gens: list, until: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:
    """check() every rank (a `.rx` RankReception each) until `until(outcomes)`; outcomes: rid -> ("ready"|error, rank) lists."""
    outcomes: dict = {"ready": {}, "failed": {}, "freed": {}}
    end = time.monotonic() + timeout_s
    while not until(outcomes):
        assert time.monotonic() < end, f"no outcome within {timeout_s}s: {outcomes}"
        for rank, gen in enumerate(gens):
            check = gen.rx.check()
            for rid in check.ready:
                outcomes["ready"].setdefault(rid, []).append(rank)
            for rid, error in check.failed.items():
                outcomes["failed"].setdefault(rid, []).append(error)
            for rid in check.freed:
                outcomes["freed"].setdefault(rid, []).append(rank)
        time.sleep(0.001)
    return outcomes


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)
