"""Speculative decoding served: a disaggregated request (router -> ctx prefill -> UCX -> a
dp 1 x cp 2 gen world with ``gen[].speculative: ngram``) beside the aggregated single-process gen
worker with the same ``speculative``.

The n-gram drafter's prompt cache is the prompt itself, which travels with the request, so the
gen world drafts from its first step exactly as the aggregated worker does after its prefill:

- the disaggregated answer is the aggregated one, and it drafts and accepts exactly the drafts
  the aggregated one does (the workers' ``/metrics`` counters move alike);
- both are plain decoding's answer: ``helixserve generate --json`` prints the same with and
  without ``--speculative ngram``, and the served text is its text;
- the counters' names and labels (per position too); a worker that does not speculate (the ctx
  worker) exports none;
- the router publishes the gen world's counters under our names and vLLM's
  (``vllm:spec_decode_*``, with ``model_name``).
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, Deployment, http, wait_until

PREFIX = "helixserve_worker_spec_decode"
SPEC = {"method": "ngram", "num_draft_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = [7, 19, 3, 42, 11] * 12  # prompt lookup drafts every step; some drafts are accepted
MAX_TOKENS = 100
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"gen": {"speculative": SPEC}, "baseline_gen": {"speculative": SPEC}}


def spec_samples(url: str) -> dict[tuple[str, frozenset], float]:
    status, text = http("GET", f"{url}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(PREFIX)}


def counts(url: str) -> dict[str, float]:
    """The worker's counters, per position as ``per_pos_<j>``."""
    out = {}
    for (name, labels), value in spec_samples(url).items():
        labels = dict(labels)
        assert labels["role"] == "gen"
        short = name.removeprefix(f"{PREFIX}_").removesuffix("_total")
        out[f"per_pos_{labels['position']}" if "position" in labels else short] = value
    return out


def complete(url: str, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS) -> str:
    status, answer = http("POST", f"{url}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == max_tokens
    return answer["choices"][0]["text"]


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def serve_both(dep: Deployment, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS) -> dict:
    """The disaggregated and the aggregated answer to ``prompt``, and what each one's worker
    counted meanwhile."""
    world_before, single_before = counts(dep.gen_url), counts(dep.baseline_url)  # the warm-ups speculated too
    disaggregated = complete(dep.router_url, prompt, max_tokens)
    world = moved(world_before, counts(dep.gen_url))
    aggregated = complete(dep.baseline_url, prompt, max_tokens)
    single = moved(single_before, counts(dep.baseline_url))
    return {"disaggregated": disaggregated, "aggregated": aggregated, "world": world, "single": single}


@pytest.fixture(scope="module")
def served(dep: Deployment) -> dict:
    """The disaggregated and the aggregated answer, and what each one's worker counted."""
    return serve_both(dep)


def test_a_disaggregated_request_accepts_the_drafts_the_aggregated_one_accepts(served):
    assert served["disaggregated"] == served["aggregated"]
    world, single = served["world"], served["single"]
    assert world == single
    assert world["num_drafts"] > 10 and 0 < world["num_accepted_tokens"] < world["num_draft_tokens"]
    assert sum(v for k, v in world.items() if k.startswith("per_pos_")) == world["num_accepted_tokens"]


def test_speculation_served_and_offline_is_plain_decoding(served, dep: Deployment, capsys):
    from helixserve.cli import main

    base = ["generate", "--model", str(dep.config.model.path), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--speculative", "ngram", "--num-draft-tokens", "3"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == MAX_TOKENS
    assert served["disaggregated"] == outputs[0]["text"]


def test_counter_names_and_labels(served, dep: Deployment):
    samples = spec_samples(dep.gen_url)
    gen = frozenset({("role", "gen")})
    for name in COUNTERS:
        assert (f"{PREFIX}_{name}_total", gen) in samples
    positions = {dict(labels)["position"] for name, labels in samples if name.endswith("_per_pos_total")}
    assert positions <= {"0", "1", "2"} and "0" in positions
    assert spec_samples(dep.ctx_url) == {}  # the ctx worker does not speculate: no such counters


def test_the_router_publishes_the_counters_under_vllms_names(served, dep: Deployment):
    want = counts(dep.gen_url)  # nothing runs on the world after `served`
    worker = {("role", "gen"), ("url", dep.gen_url)}

    def router_samples() -> dict[tuple[str, frozenset], float]:
        status, text = http("GET", f"{dep.router_url}/metrics")
        assert status == 200
        return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if "spec_decode" in s.name}

    wait_until(lambda: router_samples().get(("vllm:spec_decode_num_drafts_total",
                                             frozenset(worker | {("model_name", MODEL)}))) == want["num_drafts"],
               10, "the router's health check of the gen world")
    got = router_samples()
    for key, value in want.items():
        name, labels = key, set(worker)
        if key.startswith("per_pos_"):
            name, labels = "num_accepted_tokens_per_pos", labels | {("position", key.removeprefix("per_pos_"))}
        assert got[(f"helixserve_router_worker_spec_decode_{name}_total", frozenset(labels))] == value, key
        assert got[(f"vllm:spec_decode_{name}_total", frozenset(labels | {("model_name", MODEL)}))] == value, key
    assert not any(dict(labels)["role"] == "ctx" for _, labels in got)
