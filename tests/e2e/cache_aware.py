"""What the cache-aware routing e2e modules share: the router's view of its ctx pool (health and
the blocks its index holds per ctx worker, in ``dep.ctx_urls`` order), a ctx worker's published
blocks (``/v1/prefix_events``), which ctx worker's prefix cache looked a request up and what it
found, and the check that the router's index mirrors every ctx worker's blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tests.e2e.conftest import Deployment, http, metric

T = TypeVar("T")


def router_ctx(dep: Deployment) -> list[dict]:
    """The router's ``/ready`` entries of its ctx workers (``healthy``, ``prefix_blocks``, ...)."""
    return http("GET", f"{dep.router_url}/ready")[1]["ctx"]


def all_ctx_healthy(dep: Deployment) -> bool:
    return all(w["healthy"] for w in router_ctx(dep))


def published(url: str) -> dict:
    """A ctx worker's resync answer: its event log's ``epoch`` and every block key it caches."""
    status, answer = http("GET", f"{url}/v1/prefix_events")
    assert status == 200, answer
    return answer


def prefix_counters(dep: Deployment) -> list[tuple[float, float]]:
    """(prompt tokens looked up, found cached) per ctx worker."""
    return [(metric(url, "helixserve_worker_prefix_cache_queries_total", 0.0),
             metric(url, "helixserve_worker_prefix_cache_hits_total", 0.0)) for url in dep.ctx_urls]


def served_by(dep: Deployment, send: Callable[[], T]) -> tuple[T, int, float]:
    """``send()``'s result, the index of the one ctx worker whose prefix cache looked it up, and
    the prompt tokens that worker found cached."""
    before = prefix_counters(dep)
    result = send()
    after = prefix_counters(dep)
    served = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a[0] > b[0]]
    assert len(served) == 1, (before, after)
    return result, served[0], after[served[0]][1] - before[served[0]][1]


def mirrors_the_workers(dep: Deployment) -> bool:
    """The router's index holds exactly as many blocks as each (idle) ctx worker caches."""
    known = [w["prefix_blocks"] for w in router_ctx(dep)]
    return known == [len(published(url)["blocks"]) for url in dep.ctx_urls]
