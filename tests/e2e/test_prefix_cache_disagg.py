"""Prefix caching in disaggregated serving: router -> ctx worker (prefix caching on) -> gen world
(dp 1 x cp 2, the KV over UCX). Prompts sharing prefixes of 0, 1 block - 1, 1 block, 1 block + 1
and many blocks, across state checkpoint boundaries, answer the tokens of the aggregated baseline
(a single-process gen worker), the ctx worker counts its hits, and nothing stays allocated (the
gen world publishes nothing of a transferred request). The whole prompt's cache travels to the gen world, shared blocks included."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL, metric, wait_until

BLOCK = 4  # the deployment's tokens_per_block


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"baseline_gen": True, "cache": {"prefix_caching": True, "state_checkpoint_blocks": 2}}


def greedy_text(client, prompt: list[int]) -> tuple[str, dict]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.model_dump()


@pytest.mark.parametrize("shared", [0, BLOCK - 1, BLOCK, BLOCK + 1, 6 * BLOCK + 2])
def test_prompts_sharing_a_prefix_answer_as_aggregated_serving(dep, shared):
    base = list(range(300 + shared, 300 + 2 * shared))  # a fresh prefix per case, in the vocabulary
    prompts = [base + [11, 12, 13], base + [21, 22], base + [21, 22]]
    router, baseline = dep.client(), dep.client(dep.baseline_url)
    hits_before = metric(dep.ctx_url, "helixserve_worker_prefix_cache_hits_total", 0.0)
    for prompt in prompts:
        got, _ = greedy_text(router, prompt)
        want, _ = greedy_text(baseline, prompt)
        assert got == want, (shared, prompt)
    hits = metric(dep.ctx_url, "helixserve_worker_prefix_cache_hits_total") - hits_before
    # the repeated prompt resumes at its last full block before its last token at least
    assert hits >= (len(prompts[2]) - 1) // BLOCK * BLOCK
    wait_until(dep.is_idle, 20, "ctx and gen to free everything")
