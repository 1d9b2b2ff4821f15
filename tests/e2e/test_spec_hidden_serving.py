"""A hidden-state drafter served: a disaggregated request (router -> ctx prefill -> UCX -> a dp 1 x
cp 2 gen world, ``ctx[].speculative`` and ``gen[].speculative`` both ``method: hidden`` with the
same drafter) beside the aggregated single-process gen worker with the same ``speculative``.

The ctx worker runs the drafter over the prompt as the aggregated engine does and its prompt cache
(the drafter's pages and the target's features of the last prompt position) travels with the
request to the gen world's leader; the gen world runs the drafter on its leader
(``draft_tensor_parallel_size: 1``) or its heads over the CP group (``2``: the leader broadcasts
the received prompt cache to the group):

- the disaggregated request accepts exactly the drafts the aggregated one accepts (the gen
  world's ``/metrics`` counters moved as the aggregated worker's did, position by position) and
  its answer is the aggregated one;
- both are plain decoding's answer: ``helixserve generate --json`` prints the same with and
  without ``--speculative hidden``, and the served text is its text.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from helixserve.models.presets import make_checkpoint
from tests.e2e.conftest import Deployment
from tests.e2e.test_spec_serving import serve_both

PROMPT = [5, 77, 140, 9, 201, 33, 18, 250, 64, 120, 7, 90, 45]  # crosses 4-token pages
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    # (seed 1: an untrained drafter whose drafts for PROMPT are accepted once)
    return make_checkpoint("kimi-k3-tiny-hidden", tmp_path_factory.mktemp("hidden") / "drafter", seed=1)


def hidden_options(drafter_dir: Path, draft_tp: int = 1) -> dict:
    """The deployment options: the ctx, the gen world and the aggregated gen run the same drafter
    (the gen world's heads over ``draft_tp`` ranks)."""
    spec = {"method": "hidden", "draft_model": str(drafter_dir), "num_draft_tokens": 3}
    return {"ctx": {"speculative": spec}, "gen": {"speculative": spec | {"draft_tensor_parallel_size": draft_tp}},
            "baseline_gen": {"speculative": spec}}


@pytest.fixture(scope="module", params=[1, 2], ids=["leader", "heads-tp"])
def dep_options(request: pytest.FixtureRequest, drafter_dir: Path) -> dict:
    return hidden_options(drafter_dir, request.param)


@pytest.fixture(scope="module")
def served(dep: Deployment) -> dict:
    return serve_both(dep, PROMPT, MAX_TOKENS)


def test_a_disaggregated_request_with_a_hidden_drafter_accepts_the_aggregated_ones_drafts(served):
    assert served["disaggregated"] == served["aggregated"]
    world, single = served["world"], served["single"]
    assert world == single
    assert world["num_drafts"] > 3 and 0 < world["num_accepted_tokens"] < world["num_draft_tokens"]


@pytest.fixture(scope="module")
def generated(dep_checkpoint: Path, drafter_dir: Path) -> list[dict]:
    """``helixserve generate --json`` without and with ``--speculative hidden`` (once per module)."""
    from helixserve.cli import main

    base = ["generate", "--model", str(dep_checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--speculative", "hidden", "--draft-model", str(drafter_dir), "--num-draft-tokens", "3"]):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(base + extra) == 0
        outputs.append(json.loads(printed.getvalue()))
    return outputs


def test_the_served_answer_is_plain_decodings(served, generated):
    assert generated[1] == generated[0] and len(generated[0]["token_ids"]) == MAX_TOKENS
    assert served["disaggregated"] == generated[0]["text"]
