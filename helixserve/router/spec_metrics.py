"""The workers' speculative decoding counts on the router's ``/metrics``, under our names and
vLLM's, read at scrape time from each worker's last health check (its ``/ready`` answer's
``spec_decode``; a worker that does not speculate reports none and gets no sample):

| ours | vLLM's |
|---|---|
| ``helixserve_router_worker_spec_decode_num_drafts_total`` | ``vllm:spec_decode_num_drafts_total`` |
| ``helixserve_router_worker_spec_decode_num_draft_tokens_total`` | ``vllm:spec_decode_num_draft_tokens_total`` |
| ``helixserve_router_worker_spec_decode_num_accepted_tokens_total`` | ``vllm:spec_decode_num_accepted_tokens_total`` |
| ``helixserve_router_worker_spec_decode_num_accepted_tokens_per_pos_total{position}`` | ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` |

Counters as vLLM counts them (``num_drafts``: verified runs; per position ``j``: the runs that
accepted draft ``j`` and every one before it). Every sample has the worker's ``role`` and
``url``; vLLM's names add ``model_name``. A worker's values are its last answer's, also while it
is not healthy (a counter does not drop to 0 when one check fails); a restarted worker's
counters start again from 0, as Prometheus counters do after a reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily

from helixserve.router.metric_aliases import MODEL_LABEL
from helixserve.router.pool import WorkerPool, WorkerState

OURS = "helixserve_router_worker_spec_decode"
VLLM = "vllm:spec_decode"
COUNTERS = (
    ("num_drafts", "verified runs of draft tokens (speculating sequences per step)"),
    ("num_draft_tokens", "draft tokens proposed and verified"),
    ("num_accepted_tokens", "draft tokens accepted"),
)
PER_POS = ("num_accepted_tokens_per_pos", "verified runs that accepted the draft at this position "
           "(and every one before it)")


def spec_decode_of(worker: WorkerState) -> dict[str, Any] | None:
    """A worker's counts from its last health check (``None``: it reports none)."""
    counts = worker.stats.get("spec_decode")
    return counts if isinstance(counts, dict) else None


class SpecDecodeCollector:
    """Our and vLLM's speculative decoding counters of every speculating worker (see the
    module docstring); ``model_name``: vLLM's label."""

    def __init__(self, pools: Callable[[], list[WorkerPool]], model_name: str) -> None:
        self._pools = pools
        self._model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        workers = [(w, c) for pool in self._pools() for w in pool.workers
                   if (c := spec_decode_of(w)) is not None]
        if not workers:
            return
        for key, help_text in COUNTERS:
            ours, theirs = self._families(key, help_text, [])
            for w, counts in workers:
                ours.add_metric([w.role, w.url], float(counts.get(key, 0)))
                theirs.add_metric([self._model_name, w.role, w.url], float(counts.get(key, 0)))
            yield from (ours, theirs)
        ours, theirs = self._families(*PER_POS, ["position"])
        for w, counts in workers:
            for position, value in enumerate(counts.get("accepted_per_position", [])):
                ours.add_metric([w.role, w.url, str(position)], float(value))
                theirs.add_metric([self._model_name, w.role, w.url, str(position)], float(value))
        yield from (ours, theirs)

    @staticmethod
    def _families(key: str, help_text: str, extra: list[str]) -> tuple[CounterMetricFamily, CounterMetricFamily]:
        ours = CounterMetricFamily(f"{OURS}_{key}", help_text, labels=["role", "url", *extra])
        theirs = CounterMetricFamily(f"{VLLM}_{key}", f"{help_text} (helixserve: {OURS}_{key})",
                                     labels=[MODEL_LABEL, "role", "url", *extra])
        return ours, theirs
