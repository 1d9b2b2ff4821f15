"""vLLM's names on the router's registry (router/metric_aliases.py): one observation shows under
both names; KV usage is used / total blocks of each worker, 0 for a worker not healthy or with no
blocks, and follows the worker's next health check."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helixserve.router.metrics import RouterMetrics
from helixserve.router.pool import WorkerPool


def samples(metrics: RouterMetrics) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_one_observation_feeds_our_name_and_vllms() -> None:
    pool = WorkerPool("gen", ["http://g:1"], "round_robin")
    metrics = RouterMetrics(lambda: [pool], "m")
    metrics.ttft.observe(0.07)
    metrics.itl.observe(0.2)
    metrics.generation_tokens.inc(3)
    metrics.waiting.set(2)
    s = samples(metrics)
    m = frozenset({("model_name", "m")})
    assert s[("vllm:time_to_first_token_seconds_bucket", m | {("le", "0.1")})] == 1
    assert s[("vllm:time_to_first_token_seconds_bucket", m | {("le", "0.05")})] == 0
    assert s[("vllm:time_to_first_token_seconds_sum", m)] == s[("helixserve_router_time_to_first_token_seconds_sum", frozenset())] == 0.07
    for itl in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert s[(f"{itl}_count", m)] == 1 and s[(f"{itl}_sum", m)] == 0.2
    assert s[("vllm:generation_tokens_total", m)] == 3 and s[("vllm:prompt_tokens_total", m)] == 0
    assert s[("vllm:num_requests_waiting", m)] == 2


def test_kv_usage_per_worker_zero_when_unhealthy_or_blockless() -> None:
    ctx = WorkerPool("ctx", ["http://c:1", "http://c:2"], "round_robin")
    gen = WorkerPool("gen", ["http://g:1"], "round_robin")
    metrics = RouterMetrics(lambda: [ctx, gen], "m")
    c1, c2 = ctx.workers
    (g,) = gen.workers
    c1.is_healthy, c1.stats = True, {"num_blocks": 0, "num_used_blocks": 0}  # reports no blocks
    c2.is_healthy, c2.stats = False, {"num_blocks": 8, "num_used_blocks": 8}  # stale: not healthy
    g.is_healthy, g.stats = True, {"num_blocks": 8, "num_used_blocks": 3}

    def usage(name: str) -> dict[str, float]:
        return {dict(labels)["url"]: v for (n, labels), v in samples(metrics).items() if n == name}

    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert usage(name) == {"http://c:1": 0.0, "http://c:2": 0.0, "http://g:1": 3 / 8}
    g.stats = {"num_blocks": 8, "num_used_blocks": 8}  # the next health check: every block in use
    assert usage("vllm:kv_cache_usage_perc")["http://g:1"] == 1.0


def test_speculating_workers_counters_under_our_names_and_vllms() -> None:
    """Each speculating worker's last reported counts, under both names (vLLM's with
    ``model_name``), per position too; a worker reporting none has no sample, and a worker that
    failed its last check keeps its last counts (a counter never drops to 0 on one failed check)."""
    ctx = WorkerPool("ctx", ["http://c:1"], "round_robin")
    gen = WorkerPool("gen", ["http://g:1", "http://g:2"], "round_robin")
    metrics = RouterMetrics(lambda: [ctx, gen], "m")
    assert not any(n.startswith(("vllm:spec_decode", "helixserve_router_worker_spec")) for n, _ in samples(metrics))
    (c,) = ctx.workers
    g1, g2 = gen.workers
    c.is_healthy, c.stats = True, {"num_blocks": 8}  # does not speculate
    g1.is_healthy, g1.stats = True, {"spec_decode": {"num_drafts": 5, "num_draft_tokens": 14,
                                                     "num_accepted_tokens": 6, "accepted_per_position": [4, 2, 0]}}
    g2.is_healthy, g2.stats = False, {"spec_decode": {"num_drafts": 1, "num_draft_tokens": 3,
                                                      "num_accepted_tokens": 0, "accepted_per_position": [0, 0, 0]}}
    s = samples(metrics)
    for url, want in (("http://g:1", (5, 14, 6, [4, 2, 0])), ("http://g:2", (1, 3, 0, [0, 0, 0]))):
        ours = frozenset({("role", "gen"), ("url", url)})
        theirs = ours | {("model_name", "m")}
        for key, value in zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"), want[:3]):
            assert s[(f"helixserve_router_worker_spec_decode_{key}_total", ours)] == value
            assert s[(f"vllm:spec_decode_{key}_total", theirs)] == value
        for position, value in enumerate(want[3]):
            at = {("position", str(position))}
            assert s[("helixserve_router_worker_spec_decode_num_accepted_tokens_per_pos_total", ours | at)] == value
            assert s[("vllm:spec_decode_num_accepted_tokens_per_pos_total", theirs | at)] == value
    assert not any(dict(labels).get("role") == "ctx" for n, labels in s if "spec_decode" in n)
