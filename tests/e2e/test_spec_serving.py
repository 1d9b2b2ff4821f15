"""Speculative decoding in a real aggregated gen worker (``gen.speculative``, kv_source
``recompute``, dp = cp = 1) beside the same worker without it: greedy completions of a
repetitive prompt are the same text, and the speculating worker's ``/metrics`` counters of
drafted and accepted tokens move while the plain worker exports none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, Deployment, http, wait_until

PREFIX = "helixserve_worker_spec_decode"
PROMPT = [7, 19, 3, 42, 11] * 12  # prompt lookup finds its suffix earlier: drafts every step


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, k3_tiny: Path) -> Iterator[Deployment]:
    spec = {"method": "ngram", "num_draft_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    d = Deployment(tmp_path_factory.mktemp("spec_serving"), k3_tiny, baseline_gen=True,
                   gen={"cp": 1, "kv_source": "recompute", "speculative": spec})
    try:
        d.start("gen")
        d.start("baseline")

        def ready() -> bool:
            for role, proc in d.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{role} exited with {proc.returncode}:\n{d.log(role)}")
            try:
                return all(http("GET", f"{url}/ready", timeout=2)[0] == 200 for url in (d.gen_url, d.baseline_url))
            except OSError:
                return False
        wait_until(ready, 180, "both gen workers' /ready", interval=0.3)
        yield d
    finally:
        d.stop()


def spec_samples(url: str) -> dict[tuple[str, frozenset], float]:
    status, text = http("GET", f"{url}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(PREFIX)}


def complete(url: str, max_tokens: int) -> str:
    status, answer = http("POST", f"{url}/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == max_tokens
    return answer["choices"][0]["text"]


def test_speculating_worker_counts_drafts_and_answers_as_plain_decoding(workers: Deployment) -> None:
    gen = ("role", "gen")
    before = spec_samples(workers.gen_url)
    assert before[(f"{PREFIX}_num_drafts_total", frozenset({gen}))] >= 0
    text = complete(workers.gen_url, 24)
    after = spec_samples(workers.gen_url)
    assert text == complete(workers.baseline_url, 24)
    drafts, tokens, accepted = (
        after[(f"{PREFIX}_{name}_total", frozenset({gen}))] - before.get((f"{PREFIX}_{name}_total", frozenset({gen})), 0)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    assert drafts >= 1 and drafts <= tokens <= 3 * drafts and 0 <= accepted <= tokens
    per_pos = {dict(labels)["position"]: v for (name, labels), v in after.items()
               if name == f"{PREFIX}_num_accepted_tokens_per_pos_total"}
    assert set(per_pos) <= {"0", "1", "2"} and sum(per_pos.values()) == after[
        (f"{PREFIX}_num_accepted_tokens_total", frozenset({gen}))]
    assert spec_samples(workers.baseline_url) == {}  # speculation off: no such counters
