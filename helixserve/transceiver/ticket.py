"""The KV ticket: where a received request's prompt cache comes from, as the engine carries it.

The gen server builds one from a ``generation_only`` request's ``disaggregated_params``
(:meth:`KVTicket.from_params`); the engine passes it unread to every rank of the request's CP
group (``EngineCore.add_request(..., kv_ticket=...)``, the SPMD world's messages), and each rank's
receiver (:class:`~helixserve.transceiver.gen.receiver.KVReceiver`) reads it to ask the ctx worker for
its shard, or to copy it on the ctx's pull grant. Frozen and picklable: it crosses to the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from helixserve.protocol.disagg import DisaggregatedParams, KVLayout, PullGrant, TransceiverEndpoint
from helixserve.transceiver import fan


@dataclass(frozen=True, slots=True)
class KVTicket:
    """What a gen rank needs to receive its shard of one request's prompt cache.

    Attributes:
        ctx_request_id: the request's id on the ctx worker that holds its cache.
        ctx_endpoint: that ctx worker's transceiver (its control plane).
        layout: the cache layout the ctx advertised (checked against the rank's own).
        num_prompt_tokens: the prompt's length (what the shard covers).
        first_gen_tokens: the ctx's first tokens (checked against what it sends).
        pull_grant: the ctx's leave to copy straight out of its pools (same host), if any.
        ctx_endpoints: a ctx world's ranks' transceivers, in rank order (``layout.ctx_tp_size``
            of them); empty for one ctx rank (`ctx_endpoint`).
    """

    ctx_request_id: str
    ctx_endpoint: TransceiverEndpoint
    layout: KVLayout
    num_prompt_tokens: int
    first_gen_tokens: tuple[int, ...]
    pull_grant: PullGrant | None = None
    ctx_endpoints: tuple[TransceiverEndpoint, ...] = ()

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or not self.first_gen_tokens:
            raise ValueError(f"ctx request {self.ctx_request_id!r}: a KV ticket needs a prompt and a first token, "
                             f"got {self.num_prompt_tokens} prompt tokens and {list(self.first_gen_tokens)}")
        if self.ctx_endpoints and len(self.ctx_endpoints) != self.layout.ctx_tp_size:
            raise ValueError(f"ctx request {self.ctx_request_id!r}: {len(self.ctx_endpoints)} ctx endpoints for "
                             f"ctx_tp_size {self.layout.ctx_tp_size}")

    def source_tickets(self, cp_rank: int, cp_size: int) -> list[KVTicket]:
        """One ticket per ctx rank holding part of gen rank ``cp_rank`` of ``cp_size``'s shard
        (:func:`~helixserve.transceiver.fan.sources`), in rank order: that rank's endpoint, the
        layout naming it (``ctx_rank``). The ticket itself for one ctx rank."""
        if not self.ctx_endpoints:
            return [self]
        num_blocks = self.layout.num_blocks(self.num_prompt_tokens)
        return [replace(self, ctx_endpoint=self.ctx_endpoints[src.ctx_rank], ctx_endpoints=(), pull_grant=None,
                        layout=self.layout.model_copy(update={"ctx_rank": src.ctx_rank}))
                for src in fan.sources(num_blocks, self.layout.num_kda_heads, self.layout.ctx_tp_size, cp_rank, cp_size)]

    @classmethod
    def from_params(cls, params: DisaggregatedParams) -> KVTicket:
        """The ticket of a ``generation_only`` request (ValueError naming the request type otherwise)."""
        if not params.is_generation_only:
            raise ValueError(f"disaggregated_params must be generation_only, got {params.request_type.value}")
        assert params.ctx_request_id and params.ctx_endpoint and params.layout  # the protocol checked them
        return cls(params.ctx_request_id, params.ctx_endpoint, params.layout, len(params.prompt_token_ids),
                   tuple(params.first_gen_tokens), params.pull_grant, tuple(params.ctx_endpoints))
