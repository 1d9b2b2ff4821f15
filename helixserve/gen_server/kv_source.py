"""Stage 2 of the gen worker: how a ``generation_only`` request's prompt state enters the engine.

Sources: :class:`UcxKVSource` (``kv_source: ucx``, the default: every rank of the request's CP
group receives its shard over UCX from the ctx worker's KV sender) and :class:`RecomputeKVSource`
(``recompute``: a fallback that re-prefills on gen).

This is the seam the transceiver's receiver plugs into. A :class:`KVSource` gets the request's
:class:`~helixserve.protocol.DisaggregatedParams` (ctx_request_id, ctx endpoint, layout,
prompt_token_ids, first_gen_tokens) and yields the request's outputs from this worker's engine:

- the outputs must start with ``first_gen_tokens`` (they count as generated tokens) and equal
  what an aggregated run of the same prompt and sampling would give;
- a transfer failure or timeout must fail the stream with an engine error naming the cause
  (``KVTransferError``; ``KVTransferTimeoutError`` for a timeout, a 504 to the client), and
  the request's cache must be freed;
- closing the iterator early (client gone) must cancel the transfer and free the cache.

A receiving source allocates the request's cache and drives its transfer, then starts decoding
through ``engine.generate(request_id, prompt_token_ids, sampling, start=...)``, where ``start(core)``
runs on the engine thread and puts the request into the core already prefilled (e.g.
``core.add_prefilled_request``), returning the first tokens' updates; ``engine.call(fn)`` runs
any other core operation (allocate, read block tables) on the engine thread.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

from helixserve.config_transceiver import TransceiverConfig
from helixserve.engine.async_engine import AsyncEngine, RequestOutput
from helixserve.engine.request import SamplingParams
from helixserve.engine.errors import EngineError
from helixserve.protocol import DisaggregatedParams, KVLayout
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.serving.auth import PermissionDeniedError
from helixserve.transceiver.layout import ShardSpec, shard_segments
from helixserve.transceiver.polling import TransferMetrics
from helixserve.transceiver.gen.receiver import KVReceiver
from helixserve.transceiver.ticket import KVTicket
from helixserve.kvcache.manager import CacheHandle
from helixserve.cache_layout import ModelCaches


class KVSource(ABC):
    """Receiver-side seam; one per gen worker, picked by ``GenServerConfig.kv_source``."""

    name: ClassVar[str]

    @abstractmethod
    def generate(self, engine: AsyncEngine, request_id: str, params: DisaggregatedParams,
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs, ``first_gen_tokens`` first (see the module docstring)."""

    def stats(self) -> dict[str, float]:
        """Counters for ``/health`` and ``/stats`` (the router reads them)."""
        return {}

    def gauges(self) -> list[tuple[str, str, float]]:
        """``(name, help, value)`` for ``/metrics``."""
        return []


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


class PacedKVReceiver:
    """A rank's :class:`~helixserve.transceiver.gen.receiver.KVReceiver` (the transfer machine) as the
    engine's :class:`~helixserve.engine.kv_intake.ShardReceiver` (its seam): a step's poll waits at most ``interval_s`` for a transfer to end when the
    engine has nothing else to run (bounded local poll, no collective), so a world that only
    waits on transfers does not spin; with requests decoding it is one non-blocking pass, so
    their steps never wait on a transfer."""

    def __init__(self, receiver: KVReceiver, interval_s: float) -> None:
        self.receiver = receiver
        self.interval_s = interval_s

    def start(self, request_id: str, handle: CacheHandle, caches: ModelCaches, ticket: KVTicket) -> None:
        self.receiver.start(request_id, handle, caches, ticket)

    def poll(self, wait: bool = False) -> dict[str, str | None]:
        if wait:
            return self.receiver.poll(wait_num=1, interval_s=self.interval_s)
        return self.receiver.poll(wait_num=0)

    def cancel(self, request_id: str) -> None:
        self.receiver.cancel(request_id)

    @property
    def metrics(self) -> TransferMetrics:
        return self.receiver.metrics

    def close(self) -> None:
        self.receiver.close()


@dataclass(frozen=True, slots=True)
class UcxReceiverFactory:
    """Builds each gen world rank's receiver (pickled to the spawned ranks). ``layout`` has the
    world's *global* head counts, as a ctx worker advertises it."""

    config: TransceiverConfig
    layout: KVLayout
    ctx_hosts: tuple[str, ...] = ()  # the deployment's ctx transceivers (UCX's interface toward them)
    ctx_endpoints: tuple[tuple[str, int], ...] = ()  # their control planes (connected, pools asked for, at start)

    def __call__(self, mapping, device) -> PacedKVReceiver:  # noqa: ANN001 (parallel.Mapping, torch.device)
        # the data plane comes from config.backend's factory (transceiver.plane), which may bind
        # toward the ctx hosts (ucxx: this rank's interface on the route to them)
        receiver = KVReceiver(self.config, self.layout, cp_rank=mapping.cp_rank, cp_size=mapping.cp,
                              gen_rank=mapping.rank, peer_hosts=self.ctx_hosts)
        receiver.warm_up(device)  # compiles the pull's copy kernel before the worker is ready
        endpoints = [TransceiverEndpoint(host=h, port=p) for h, p in self.ctx_endpoints]
        receiver.connect_ahead(endpoints)
        receiver.prefetch(endpoints, device)
        return PacedKVReceiver(receiver, self.config.poll_interval_s)


class UcxKVSource(KVSource):
    """THE data path: the request goes to the gen world with its ``KVTicket`` (built from its params); every rank
    of the CP group it lands on allocates its shard and its receiver asks the ctx sender for
    exactly that shard, polled once per executor step (bounded); the group's ranks agree through
    ``transceiver.consensus``: decoding starts once every rank has its shard, and the request fails
    on every rank when one rank's transfer failed or timed out (the client gets a 503 / 504 naming the ctx worker, the rank and the
    cause, from :meth:`~helixserve.serving.world_core.WorldCore.failure_error`). A request whose client left is aborted: each
    rank cancels its transfer (the ctx stops sending) and frees its blocks once nothing can write.

    Only ctx endpoints of the deployment are dialled (``ctx_endpoints``: every ctx worker's
    ``transceiver_host:transceiver_port``, and a ctx world's every rank's port after it): a
    request naming another one (its ``ctx_endpoint`` or any of a ctx world's ``ctx_endpoints``)
    is refused with 403 naming it before anything is allocated or any connection is opened.

    Counts per request (whole CP group): completed / failed transfers, bytes (the shards' sizes)
    and seconds from admission to the prompt state ready on every rank.
    """

    name = "ucx"

    def __init__(self, layout: KVLayout, config: TransceiverConfig, cp: int,
                 ctx_endpoints: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.layout = layout
        self.config = config
        self.cp = cp
        self.ctx_endpoints = ctx_endpoints
        self.num_completed = 0
        self.num_failed = 0
        self.bytes_received = 0
        self.seconds_received = 0.0

    def receiver_factory(self) -> UcxReceiverFactory:
        return UcxReceiverFactory(self.config, self.layout, tuple(sorted({h for h, _ in self.ctx_endpoints})),
                                  tuple(sorted(self.ctx_endpoints)))

    def generate(self, engine: AsyncEngine, request_id: str, params: DisaggregatedParams,
                 sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.check_endpoint(params)
        return self._generate(engine, request_id, params, sampling)

    def check_endpoint(self, params: DisaggregatedParams) -> None:
        """403 unless ``params.ctx_endpoint`` and every one of ``params.ctx_endpoints`` (a ctx
        world's ranks) is one of the deployment's ctx transceivers; the first outside it is named."""
        assert params.ctx_endpoint is not None  # validated by the protocol for generation_only
        named = [("disaggregated_params.ctx_endpoint", params.ctx_endpoint)]
        named += [(f"disaggregated_params.ctx_endpoints[{i}]", e) for i, e in enumerate(params.ctx_endpoints)]
        for param, endpoint in named:
            if (endpoint.host, endpoint.port) not in self.ctx_endpoints:
                raise PermissionDeniedError(
                    f"{param.removeprefix('disaggregated_params.')} {endpoint.host}:{endpoint.port} is not a "
                    "ctx transceiver of this deployment", param=param, code="ctx_endpoint_not_allowed")

    async def _generate(self, engine: AsyncEngine, request_id: str, params: DisaggregatedParams,
                        sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        prompt = list(params.prompt_token_ids)
        ticket = KVTicket.from_params(params)

        def start(core) -> None:  # noqa: ANN001 (the world's rank-0 core, on the engine thread)
            core.add_request(request_id, prompt, sampling,
                             forced_output_token_ids=params.first_gen_tokens, kv_ticket=ticket)

        began, is_received = time.monotonic(), False
        try:
            async with contextlib.aclosing(engine.generate(request_id, prompt, sampling, start=start)) as outputs:
                async for out in outputs:
                    if not is_received:
                        is_received = True
                        self._count_received(len(prompt), time.monotonic() - began, ticket.layout)
                    yield out
        except EngineError as err:
            if not is_received and err.code in KV_ERROR_CODES:
                self.num_failed += 1
            raise

    def _count_received(self, num_prompt_tokens: int, seconds: float, advertised: KVLayout) -> None:
        self.num_completed += 1
        self.seconds_received += seconds
        # a drafter's prompt cache came along when the ctx advertised this worker's drafter
        layout = self.layout
        if advertised.draft != layout.draft:
            layout = layout.model_copy(update={"draft": None})
        self.bytes_received += sum(segment.nbytes for cp_rank in range(self.cp) for segment in
                                   shard_segments(ShardSpec(layout, num_prompt_tokens, cp_rank, self.cp)))

    def stats(self) -> dict[str, float]:
        return {"kv_transfer_bytes": self.bytes_received, "kv_transfer_seconds": self.seconds_received,
                "kv_transfers_completed": self.num_completed, "kv_transfer_failures": self.num_failed}

    def gauges(self) -> list[tuple[str, str, float]]:
        return [
            ("kv_transfer_bytes_total", "KV bytes received by whole CP groups", self.bytes_received),
            ("kv_transfer_seconds_total", "admission to prompt state on every CP rank, summed",
             self.seconds_received),
            ("kv_transfers_completed_total", "requests received by every rank of their CP group",
             self.num_completed),
            ("kv_transfer_failures_total", "requests whose KV transfer failed or timed out", self.num_failed),
        ]


KV_ERROR_CODES = ("kv_transfer_failed", "kv_transfer_timeout")
KV_SOURCES: dict[str, type[KVSource]] = {RecomputeKVSource.name: RecomputeKVSource,
                                         UcxKVSource.name: UcxKVSource}


def make_kv_source(name: str, layout: KVLayout, config: TransceiverConfig, cp: int,
                   ctx_endpoints: frozenset[tuple[str, int]] = frozenset()) -> KVSource:
    """The gen worker's source by its config name (``GenServerConfig.kv_source``);
    ``ctx_endpoints``: the only ctx transceivers a ``ucx`` source may dial."""
    if name == UcxKVSource.name:
        return UcxKVSource(layout, config, cp, ctx_endpoints)
    if name == RecomputeKVSource.name:
        return RecomputeKVSource()
    raise ValueError(f"unknown kv_source {name!r}; choose one of {sorted(KV_SOURCES)}")
