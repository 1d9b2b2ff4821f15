"""A draft model served: a disaggregated request (router -> ctx prefill -> UCX -> a dp 1 x cp 2 gen
world with ``gen[].speculative.method: draft``) beside the aggregated single-process gen worker
with the same ``speculative``.

The gen world's draft model runs on both ranks of its CP group, its heads split
(``draft_tensor_parallel_size: 2``). Its prompt cache is not transferred: the gen world runs the
received prompt through the draft model when the request starts decoding (the leader sends its
rows to the other rank), so its drafts from the first step are the aggregated worker's after its
prefill (the split's fp32 rounding could change a draft; on this tiny model it does not):

- the disaggregated answer is the aggregated one, it drafts and accepts exactly the drafts the
  aggregated one does (the workers' ``/metrics`` counters, per position too, move alike), and
  some drafts are rejected;
- both are plain decoding's answer: ``helixserve generate --json`` prints the same with and
  without ``--speculative draft``, and the served text is its text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helixserve.testing.drafts import perturbed_checkpoint
from tests.e2e.conftest import Deployment
from tests.e2e.test_spec_serving import serve_both

PROMPT = [5, 77, 140, 9, 201, 33, 18, 250, 64, 120, 7, 90, 45]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def draft_dir(k3_tiny, tmp_path_factory) -> Path:
    """A draft near the target: it accepts runs and rejects drafts."""
    return perturbed_checkpoint(k3_tiny, tmp_path_factory.mktemp("draft") / "near", scale=0.01, seed=1)


@pytest.fixture(scope="module")
def dep_options(draft_dir: Path) -> dict:
    spec = {"method": "draft", "draft_model": str(draft_dir), "num_draft_tokens": 3}
    # the gen world's draft runs on both ranks, its heads split
    return {"gen": {"speculative": {**spec, "draft_tensor_parallel_size": 2}}, "baseline_gen": {"speculative": spec}}


@pytest.fixture(scope="module")
def served(dep: Deployment) -> dict:
    return serve_both(dep, PROMPT, MAX_TOKENS)


def test_a_disaggregated_request_accepts_the_drafts_the_aggregated_one_accepts(served):
    assert served["disaggregated"] == served["aggregated"]
    world, single = served["world"], served["single"]
    assert world == single
    assert world["num_drafts"] > 5 and 0 < world["num_accepted_tokens"] < world["num_draft_tokens"]
    assert sum(v for k, v in world.items() if k.startswith("per_pos_")) == world["num_accepted_tokens"]


def test_the_served_answer_is_plain_decodings(served, dep: Deployment, draft_dir: Path, capsys):
    from helixserve.cli import main

    base = ["generate", "--model", str(dep.config.model.path), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--speculative", "draft", "--draft-model", str(draft_dir), "--num-draft-tokens", "3"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == MAX_TOKENS
    assert served["disaggregated"] == outputs[0]["text"]
