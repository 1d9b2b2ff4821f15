"""Router worker pools (torch-free): policies, health state, the 503 naming every worker."""

import pytest

from helixserve.protocol import QueueFullError, ServiceUnavailableError

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


def _with_capacity(pool: WorkerPool, *capacities: int | None) -> WorkerPool:
    for worker, capacity in zip(pool.workers, capacities, strict=True):
        worker.stats = {} if capacity is None else {"capacity": capacity}
    return pool


def test_pool_capacity_sums_the_healthy_workers_answers():
    pool = _with_capacity(_pool("round_robin"), 2, 3, 4)
    assert pool.capacity == 9 and pool.workers[0].capacity == 2
    pool.mark_failed(pool.workers[2], "ReadError: boom")
    assert pool.capacity == 5
    _with_capacity(pool, 2, None, 4)  # a healthy worker that does not say: no limit known
    assert pool.capacity is None
    for worker in pool.workers:
        pool.mark_failed(worker, "down")
    assert pool.capacity is None
    for bogus in (True, -1, "8", 2.5):
        pool.workers[0].stats = {"capacity": bogus}
        assert pool.workers[0].capacity is None


def test_pick_skips_a_worker_at_its_capacity_and_429s_when_all_are():
    pool = _with_capacity(_pool("round_robin"), 1, 1, 1)
    pool.workers[0].num_inflight = 1  # a: full (capacity - 1 + 1)
    assert {pool.pick().url for _ in range(4)} == {"http://b", "http://c"}
    pool.workers[1].num_inflight = pool.workers[2].num_inflight = 1
    with pytest.raises(QueueFullError, match="every healthy gen worker is at its capacity") as info:
        pool.pick()
    assert info.value.status_code == 429 and info.value.headers["Retry-After"] == "1"
