"""``/metrics`` of a worker's speculative decoding, read at scrape time from its engine's
:class:`~helixserve.engine.spec.stats.SpecDecodeStats` (counted as vLLM counts them):

| ours | vLLM's |
|---|---|
| ``helixserve_worker_spec_decode_num_drafts_total`` | ``vllm:spec_decode_num_drafts`` |
| ``helixserve_worker_spec_decode_num_draft_tokens_total`` | ``vllm:spec_decode_num_draft_tokens`` |
| ``helixserve_worker_spec_decode_num_accepted_tokens_total`` | ``vllm:spec_decode_num_accepted_tokens`` |
| ``helixserve_worker_spec_decode_num_accepted_tokens_per_pos_total{position}`` | ``vllm:spec_decode_num_accepted_tokens_per_pos`` |

``num_drafts`` counts verified runs (one per speculating sequence per step); acceptance is
accepted / draft tokens, per position ``per_pos{position=j} / num_drafts``. Every sample has the
worker's ``role`` label, as its other metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client.core import CounterMetricFamily

from helixserve.engine.spec.stats import SpecDecodeStats

PREFIX = "helixserve_worker_spec_decode"
COUNTERS = (
    ("num_drafts", "verified runs of draft tokens (speculating sequences per step)"),
    ("num_draft_tokens", "draft tokens proposed and verified"),
    ("num_accepted_tokens", "draft tokens accepted"),
)


class SpecDecodeCollector:
    """A prometheus collector of one engine's speculative decoding counters; ``labels``: constant
    labels (a worker's ``{"role": "gen"}``)."""

    def __init__(self, stats: Callable[[], SpecDecodeStats], labels: Mapping[str, str]) -> None:
        self._stats = stats
        self._labels = dict(labels)

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        stats = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for name, help_text in COUNTERS:
            counter = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=names)
            counter.add_metric(values, getattr(stats, name))
            yield counter
        per_pos = CounterMetricFamily(f"{PREFIX}_num_accepted_tokens_per_pos",
                                      "verified runs that accepted the draft at this position (and every "
                                      "one before it)", labels=[*names, "position"])
        for position, count in enumerate(list(stats.accepted_per_position)):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos
