"""``/metrics`` of a worker's prefix cache, read at scrape time from its engine's
:class:`~helixserve.kvcache.prefix_manager.PrefixCachingCacheManager` (counted as vLLM counts them:
prompt tokens looked up at admission, and those found cached):

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

from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager

PREFIX = "helixserve_worker"


class PrefixCacheCollector:
    """A prometheus collector of one engine's prefix cache; ``labels``: constant labels."""

    def __init__(self, cache: Callable[[], PrefixCachingCacheManager], labels: Mapping[str, str]) -> None:
        self._cache = cache
        self._labels = dict(labels)

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        cache = self._cache()
        stats = cache.prefix_stats
        names, values = list(self._labels), list(self._labels.values())
        counters = (
            ("prefix_cache_queries", "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             stats.num_queried_tokens),
            ("prefix_cache_hits", "vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
             stats.num_hit_tokens),
        )
        for ours, vllm, help_text, value in counters:
            for name in (f"{PREFIX}_{ours}", vllm):
                counter = CounterMetricFamily(name, help_text, labels=names)
                counter.add_metric(values, value)
                yield counter
        evictions = CounterMetricFamily(f"{PREFIX}_prefix_cache_evictions", "cached blocks evicted for new ones",
                                        labels=names)
        evictions.add_metric(values, cache.blocks.num_evictions)
        yield evictions
        gauges = (
            ("prefix_cache_blocks", "MLA blocks named by content (held or evictable)", cache.blocks.num_cached),
            ("state_checkpoints_used", "KDA state checkpoints kept", cache.checkpoints.num_committed),
            ("state_checkpoints_total", "KDA state checkpoint slots", cache.checkpoints.capacity),
        )
        for name, help_text, value in gauges:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=names)
            gauge.add_metric(values, float(value))
            yield gauge
