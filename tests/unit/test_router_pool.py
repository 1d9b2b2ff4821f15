"""Router worker pools (torch-free): policies, health state, the 503 naming every worker."""

import pytest

from helixserve.protocol import ServiceUnavailableError

pytest.importorskip("aiohttp", reason="server deps (fastapi, uvicorn, aiohttp, prometheus-client) not installed")
from helixserve.router.pool import WorkerPool  # noqa: E402


def _pool(policy: str) -> WorkerPool:
    pool = WorkerPool("gen", ["http://a", "http://b", "http://c"], policy)
    for w in pool.workers:
        w.is_healthy, w.last_error = True, None
    return pool


def test_round_robin_cycles_over_healthy_workers():
    pool = _pool("round_robin")
    pool.mark_failed(pool.workers[1], "ConnectError: refused")
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://c", "http://a", "http://c"]


def test_least_loaded_prefers_fewest_inflight():
    pool = _pool("least_loaded")
    pool.workers[0].num_inflight, pool.workers[1].num_inflight, pool.workers[2].num_inflight = 3, 1, 2
    assert pool.pick().url == "http://b"
    pool.workers[1].num_inflight = 5
    assert pool.pick().url == "http://c"


def test_no_healthy_worker_is_a_503_naming_each_cause():
    pool = WorkerPool("ctx", ["http://x"], "round_robin")
    with pytest.raises(ServiceUnavailableError, match="no healthy ctx worker: http://x \\(not checked yet\\)"):
        pool.pick()
    pool.workers[0].is_healthy = True
    pool.mark_failed(pool.workers[0], "ReadError: boom")
    with pytest.raises(ServiceUnavailableError, match="ReadError: boom") as info:
        pool.pick()
    assert info.value.status_code == 503


def test_a_pool_needs_workers():
    with pytest.raises(ValueError, match="no gen workers"):
        WorkerPool("gen", [], "round_robin")
