"""The router's Prometheus metrics (one registry per router app)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from helixserve.router.metric_aliases import VllmAliases, worker_stat
from helixserve.router.pool import WorkerPool
from helixserve.router.spec_metrics import SpecDecodeCollector
from helixserve.serving.connection_metrics import ConnectionCollector, ConnectionCounts

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector:
    """Per-worker gauges read at scrape time from the pools' last health checks."""

    def __init__(self, pools: Callable[[], list[WorkerPool]]) -> None:
        self._pools = pools

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        specs = [
            ("healthy", "1 if the worker passed its last health check", None),
            ("inflight", "requests this router has on the worker", None),
            ("requests_running", "running requests (worker's engine)", "num_running"),
            ("requests_waiting", "waiting requests (worker's engine)", "num_waiting"),
            ("requests_held", "prefills held for its gen worker (ctx)", "num_held"),
            ("cache_blocks_used", "MLA cache blocks in use", "num_used_blocks"),
            ("cache_blocks_total", "MLA cache blocks", "num_blocks"),
            ("kv_transfer_bytes", "KV bytes transferred (ctx: sent and acknowledged; gen: "
             "received by whole CP groups)", "kv_transfer_bytes"),
            ("kv_transfer_seconds", "KV transfer seconds, summed (ctx: hold to last ack; gen: "
             "admission to prompt state on every CP rank)", "kv_transfer_seconds"),
            ("kv_transfers_completed", "completed KV transfers", "kv_transfers_completed"),
            ("kv_transfer_failures", "failed or timed-out KV transfers", "kv_transfer_failures"),
        ]
        for name, help_text, key in specs:
            family = GaugeMetricFamily(f"helixserve_router_worker_{name}", help_text,
                                       labels=["role", "url"])
            for pool in self._pools():
                for w in pool.workers:
                    if key is None:
                        value = float(w.is_healthy) if name == "healthy" else float(w.num_inflight)
                    else:
                        value = worker_stat(w, key)
                    family.add_metric([w.role, w.url], value)
            yield family
        blocks = GaugeMetricFamily("helixserve_router_worker_prefix_blocks",
                                   "blocks the router knows the ctx worker caches (cache_aware)", labels=["role", "url"])
        for pool in self._pools():
            if pool.prefix_index is not None:
                for w in pool.workers:
                    blocks.add_metric([w.role, w.url], float(pool.prefix_index.num_blocks(w.url)))
        yield blocks


class RouterMetrics:
    """Ours (``helixserve_router_*``) and, from the same metric objects, vLLM's names for the
    latency, token, running/waiting and KV usage ones (``metric_aliases.py``), labelled with
    ``model_name``; the workers' speculative decoding counters under both (``spec_metrics.py``)."""

    def __init__(self, pools: Callable[[], list[WorkerPool]], model_name: str,
                 connections: ConnectionCounts = lambda: None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("helixserve_router_requests", "requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("helixserve_router_time_to_first_token_seconds",
                              "arrival to first token sent (streamed requests)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("helixserve_router_inter_token_latency_seconds",
                             "gap between content chunks of a stream", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("helixserve_router_e2e_request_latency_seconds",
                             "arrival to last byte", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("helixserve_router_queue_time_seconds",
                                    "time waiting for an inflight slot", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter("helixserve_router_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("helixserve_router_generation_tokens",
                                         "generated tokens", registry=r)
        self.running = Gauge("helixserve_router_requests_running", "requests forwarded to workers",
                             registry=r)
        self.waiting = Gauge("helixserve_router_requests_waiting",
                             "requests waiting for an inflight slot", registry=r)
        self.handoff_failures = Counter("helixserve_router_kv_handoff_failures",
                                        "requests that failed on gen after ctx prefilled them",
                                        registry=r)
        r.register(_PoolCollector(pools))
        r.register(ConnectionCollector("helixserve_router", connections))
        r.register(VllmAliases(model_name, [
            (self.ttft, "vllm:time_to_first_token_seconds"),
            (self.itl, "vllm:inter_token_latency_seconds"),
            (self.itl, "vllm:time_per_output_token_seconds"),
            (self.e2e, "vllm:e2e_request_latency_seconds"),
            (self.queue_time, "vllm:request_queue_time_seconds"),
            (self.prompt_tokens, "vllm:prompt_tokens"),
            (self.generation_tokens, "vllm:generation_tokens"),
            (self.running, "vllm:num_requests_running"),
            (self.waiting, "vllm:num_requests_waiting"),
        ], pools))
        r.register(SpecDecodeCollector(pools, model_name))

    def count_usage(self, usage: dict | None) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
            self.generation_tokens.inc(usage.get("completion_tokens", 0))
