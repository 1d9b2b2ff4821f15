"""vLLM's metric names for the router's metrics, so dashboards built for vLLM read helixserve.

Each alias is re-exported at scrape time from the metric object it aliases (the same histogram
buckets, counter and gauge values; one observation feeds both names), with vLLM's ``model_name``
label added. Names and types as vLLM exports them (``vllm/v1/metrics/loggers.py``):

| vLLM name | type | ours |
|---|---|---|
| ``vllm:time_to_first_token_seconds`` | histogram | ``helixserve_router_time_to_first_token_seconds`` |
| ``vllm:inter_token_latency_seconds`` | histogram | ``helixserve_router_inter_token_latency_seconds`` |
| ``vllm:time_per_output_token_seconds`` | histogram | the same (vLLM's older name for it) |
| ``vllm:e2e_request_latency_seconds`` | histogram | ``helixserve_router_e2e_request_latency_seconds`` |
| ``vllm:request_queue_time_seconds`` | histogram | ``helixserve_router_queue_time_seconds`` |
| ``vllm:prompt_tokens_total`` | counter | ``helixserve_router_prompt_tokens_total`` |
| ``vllm:generation_tokens_total`` | counter | ``helixserve_router_generation_tokens_total`` |
| ``vllm:num_requests_running`` | gauge | ``helixserve_router_requests_running`` |
| ``vllm:num_requests_waiting`` | gauge | ``helixserve_router_requests_waiting`` |
| ``vllm:kv_cache_usage_perc`` | gauge | ``helixserve_router_worker_cache_blocks_{used / total}`` |
| ``vllm:gpu_cache_usage_perc`` | gauge | the same (vLLM's name for it before 0.9) |

The KV usage gauges keep our ``role`` and ``url`` labels: one sample per worker, a fraction
(1 = every MLA cache block in use), from the same last health check as the worker gauges. The
speculating workers' ``vllm:spec_decode_*`` counters: :mod:`helixserve.router.spec_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from helixserve.router.pool import WorkerPool, WorkerState

MODEL_LABEL = "model_name"  # vLLM's label for the served model's name
KV_USAGE_ALIASES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def worker_stat(worker: WorkerState, key: str) -> float:
    """A worker's figure from its last health check (0 while it is not healthy)."""
    return float(worker.stats.get(key, 0)) if worker.is_healthy else 0.0


def kv_usage(worker: WorkerState) -> float:
    """The fraction of a worker's MLA cache blocks in use (0 when it reports none)."""
    total = worker_stat(worker, "num_blocks")
    return worker_stat(worker, "num_used_blocks") / total if total > 0 else 0.0


def renamed(family: Metric, alias: str, extra_labels: dict[str, str]) -> Metric:
    """``family`` under the name ``alias`` (each sample keeps its suffix: ``_total``,
    ``_bucket``, ...), ``extra_labels`` added to every sample."""
    out = Metric(alias, f"{family.documentation} (helixserve: {family.name})", family.type)
    for s in family.samples:
        out.add_sample(alias + s.name[len(family.name):], {**s.labels, **extra_labels}, s.value,
                       s.timestamp, s.exemplar)
    return out


class VllmAliases:
    """A collector yielding ``aliases`` (``(metric, vLLM name)``) and the KV usage gauges
    under vLLM's names, labelled ``model_name=model_name``."""

    def __init__(self, model_name: str, aliases: list[tuple[MetricWrapperBase, str]],
                 pools: Callable[[], list[WorkerPool]]) -> None:
        self._labels = {MODEL_LABEL: model_name}
        self._aliases = aliases
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        for metric, alias in self._aliases:
            for family in metric.collect():
                yield renamed(family, alias, self._labels)
        for alias in KV_USAGE_ALIASES:
            family = GaugeMetricFamily(alias, "KV-cache usage per worker, 1 = every MLA cache "
                                       "block in use (helixserve: helixserve_router_worker_"
                                       "cache_blocks_used / _total)",
                                       labels=[MODEL_LABEL, "role", "url"])
            for pool in self._pools():
                for w in pool.workers:
                    family.add_metric([self._labels[MODEL_LABEL], w.role, w.url], kv_usage(w))
            yield family
