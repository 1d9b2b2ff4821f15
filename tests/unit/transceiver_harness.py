"""The ctx and gen ends the transceiver's in-process tests share (no model: seeded random cache
contents; the oracle slices the ctx tensors directly). Test files add their receiver on top of
:class:`GenPools` (a plain ``KVReceiver`` or a ``CPGroupReceiver``)."""

from __future__ import annotations

import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.config_transceiver import TransceiverConfig
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.transceiver.layout import layout_for
from helixserve.transceiver.ctx.sender import KVSender

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
