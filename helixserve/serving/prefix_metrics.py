"""``/metrics`` of a worker's prefix cache, read at scrape time: a single-process engine's
:class:`~helixserve.kvcache.prefix_manager.PrefixCachingCacheManager`, or a world's CP groups'
summed (each group's leader reports its own after every step); counted as vLLM counts them:
prompt tokens looked up at admission, and those found cached:

| ours | vLLM's |
|---|---|
| ``helixserve_worker_prefix_cache_queries_total`` (tokens) | ``vllm:prefix_cache_queries_total`` |
| ``helixserve_worker_prefix_cache_hits_total`` (tokens) | ``vllm:prefix_cache_hits_total`` |
| ``helixserve_worker_prefix_cache_blocks`` (gauge: blocks named by content, held or evictable) | |
| ``helixserve_worker_state_checkpoints_used`` / ``_total`` (gauges) | |
| ``helixserve_worker_prefix_cache_evictions_total`` (blocks) | |

Every sample has the worker's ``role`` label, as its other metrics. The hit rate is hits / queries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot

PREFIX = "helixserve_worker"


class PrefixCacheCollector:
    """A prometheus collector of one engine's or world's prefix cache; ``labels``: constant labels."""

    def __init__(self, snapshot: Callable[[], PrefixCacheSnapshot], labels: Mapping[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = dict(labels)

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        now = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())
        counters = (
            ("prefix_cache_queries", "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             now.queried_tokens),
            ("prefix_cache_hits", "vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
             now.hit_tokens),
        )
        for ours, vllm, help_text, value in counters:
            for name in (f"{PREFIX}_{ours}", vllm):
                counter = CounterMetricFamily(name, help_text, labels=names)
                counter.add_metric(values, value)
                yield counter
        evictions = CounterMetricFamily(f"{PREFIX}_prefix_cache_evictions", "cached blocks evicted for new ones",
                                        labels=names)
        evictions.add_metric(values, now.evictions)
        yield evictions
        gauges = (
            ("prefix_cache_blocks", "MLA blocks named by content (held or evictable)", now.cached_blocks),
            ("state_checkpoints_used", "KDA state checkpoints kept", now.checkpoints_used),
            ("state_checkpoints_total", "KDA state checkpoint slots", now.checkpoints_total),
        )
        for name, help_text, value in gauges:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=names)
            gauge.add_metric(values, float(value))
            yield gauge
