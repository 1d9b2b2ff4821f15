"""The gen worker's ``/metrics`` show every gen world rank's cache, labelled by ``dp_rank`` and
``cp_rank``, and the unlabelled totals are their sums: a request's blocks show on BOTH CP ranks
of the dp 1 x cp 2 world (helix ownership splits its blocks, the KDA heads split its slots)
while it runs, and go back to zero on both once it finished."""

from __future__ import annotations

import http.client as httplib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from tests.e2e.conftest import MODEL, Deployment, http, metric, wait_until

SHARED_DEPLOYMENT = "disagg"  # conftest: one deployment for these modules

RANK_GAUGES = ("rank_cache_blocks_used", "rank_cache_blocks_total", "rank_state_slots_used",
               "rank_state_slots_total")
SAMPLE = re.compile(r"^helixserve_worker_(\w+)\{(.*)\} (\S+)$")


def rank_samples(url: str) -> dict[str, dict[tuple[int, int], float]]:
    """``gauge -> {(dp_rank, cp_rank): value}`` of the per-rank cache gauges on ``/metrics``."""
    _, text = http("GET", f"{url}/metrics")
    out: dict[str, dict[tuple[int, int], float]] = {name: {} for name in RANK_GAUGES}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match[1] not in out:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
        assert labels["role"] == "gen", line
        out[match[1]][(int(labels["dp_rank"]), int(labels["cp_rank"]))] = float(match[3])
    return out


def _used_on_every_rank(dep: Deployment) -> bool:
    s = rank_samples(dep.gen_url)
    return all(s[name].get((0, cp), 0) > 0 for name in ("rank_cache_blocks_used", "rank_state_slots_used")
               for cp in (0, 1))


def _all_ranks_zero(dep: Deployment) -> bool:
    s = rank_samples(dep.gen_url)
    return (set(s["rank_cache_blocks_used"]) == {(0, 0), (0, 1)}
            and all(v == 0 for name in ("rank_cache_blocks_used", "rank_state_slots_used")
                    for v in s[name].values())
            and metric(dep.gen_url, "helixserve_worker_cache_blocks_used") == 0)


def _stream(url: str, prompt: list[int], max_tokens: int) -> httplib.HTTPConnection:
    parsed = urlparse(url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_every_cp_rank_reports_its_blocks_and_totals_are_their_sums(dep):
    before = rank_samples(dep.gen_url)
    assert set(before["rank_cache_blocks_total"]) == {(0, 0), (0, 1)}, before
    assert all(v > 0 for v in before["rank_cache_blocks_total"].values())
    assert metric(dep.gen_url, "helixserve_worker_cache_blocks_total") == sum(before["rank_cache_blocks_total"].values())
    assert metric(dep.gen_url, "helixserve_worker_state_slots_total") == sum(before["rank_state_slots_total"].values())

    conn = _stream(dep.router_url, list(range(30)), 200)  # 8 blocks of 4 tokens: 4 on each CP rank
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # gen is decoding it
    wait_until(lambda: _used_on_every_rank(dep), 10, "blocks and slots in use on both CP ranks")
    text = response.read().decode()  # to the end of the stream: the request finishes on its own
    conn.close()
    assert text.rstrip().endswith("data: [DONE]")
    wait_until(lambda: _all_ranks_zero(dep), 10, "zero blocks in use on every CP rank")


def test_concurrent_requests_leave_every_cp_rank_empty(dep):
    def one(i: int) -> str:
        conn = _stream(dep.router_url, list(range(i, i + 5 + 3 * i)), 24)
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(one, range(6)))
    assert all(t.rstrip().endswith("data: [DONE]") for t in texts)
    wait_until(lambda: _all_ranks_zero(dep), 10, "zero blocks in use on every CP rank")
    assert dep.stats("gen")["num_used_blocks"] == dep.stats("gen")["num_used_slots"] == 0
