"""The ctx and gen ends the transceiver's in-process tests share (no model: seeded random cache
contents; the oracle slices the ctx tensors directly). Test files add their receiver on top of
:class:`GenPools`: a plain ``KVReceiver``, or :class:`RankReception`, a gen world rank's
receptions through the servers' own ``RankTransfers`` and ``TransferConsensus``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helixserve.cache_layout import ModelCaches, cache_spec_for
from helixserve.config_transceiver import TransceiverConfig
from helixserve.engine.kv_intake import RankTransfers
from helixserve.gen_server.kv_source import PacedKVReceiver
from helixserve.kvcache.manager import CacheHandle, CacheManager
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol.disagg import DisaggregatedParams
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
            "conv": {i: torch.cat([c.conv_state[i][handle.slot, s * H * K + h0 * K: s * H * K + h1 * K]
                                   for s in range(3)]) for i in c.conv_state},
        }

    def close(self) -> None:
        self.sender.stop()


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
        self._started: dict[str, DisaggregatedParams] = {}
        self._freed: list[str] = []

    def begin(self, request_id: str, params: DisaggregatedParams) -> CacheHandle:
        handle = self.cache_manager.allocate(request_id, len(params.prompt_token_ids))
        self._started[request_id] = params
        self.transfers.start(request_id, handle, KVTicket.from_params(params))  # as the gen server does
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
