"""Stage 2 of the gen worker: how a ``generation_only`` request's prompt state enters the engine.

This is the seam the transceiver's receiver plugs into. A :class:`KVSource` gets the request's
:class:`~helixserve.protocol.DisaggregatedParams` (ctx_request_id, ctx endpoint, layout,
prompt_token_ids, first_gen_tokens) and yields the request's outputs from this worker's engine:

- the outputs must start with ``first_gen_tokens`` (they count as generated tokens) and equal
  what an aggregated run of the same prompt and sampling would give;
- a transfer failure or timeout must fail the stream with an ``OpenAIError`` naming the cause
  (``GatewayTimeoutError`` for a timeout), and the request's cache must be freed;
- closing the iterator early (client gone) must cancel the transfer and free the cache.

A receiving source allocates the request's cache and drives its transfer, then starts decoding
through ``engine.generate(request_id, prompt_token_ids, sampling, start=...)``, where ``start(core)``
runs on the engine thread and puts the request into the core already prefilled (e.g.
``core.add_prefilled_request``), returning the first tokens' updates; ``engine.call(fn)`` runs
any other core operation (allocate, read block tables) on the engine thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import ClassVar

from helixserve.engine.async_engine import AsyncEngine, RequestOutput
from helixserve.engine.request import SamplingParams
from helixserve.protocol import DisaggregatedParams


class KVSource(ABC):
    """Receiver-side seam; one per gen worker, picked by ``GenServerConfig.kv_source``."""

    name: ClassVar[str]

    @abstractmethod
    def generate(self, engine: AsyncEngine, request_id: str, params: DisaggregatedParams,
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs, ``first_gen_tokens`` first (see the module docstring)."""


class RecomputeKVSource(KVSource):
    """FALLBACK, not the disaggregated data path: nothing is transferred. The gen worker prefills
    ``prompt_token_ids`` itself (recomputing the KV and KDA state the ctx worker already holds),
    then its first output is forced to ``first_gen_tokens`` (the token is still sampled and
    discarded, so a seeded generator advances exactly as in an aggregated run). Answers are
    identical to aggregated ones; the cost is a second prefill on the gen worker.
    """

    name = "recompute"

    def generate(self, engine: AsyncEngine, request_id: str, params: DisaggregatedParams,
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        return engine.generate(request_id, list(params.prompt_token_ids), sampling,
                               forced_output_token_ids=params.first_gen_tokens)


KV_SOURCES: dict[str, type[KVSource]] = {RecomputeKVSource.name: RecomputeKVSource}


def make_kv_source(name: str) -> KVSource:
    if name not in KV_SOURCES:
        raise ValueError(f"unknown kv_source {name!r}; choose one of {sorted(KV_SOURCES)}")
    return KV_SOURCES[name]()
