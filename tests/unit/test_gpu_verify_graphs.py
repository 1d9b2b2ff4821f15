"""Verify steps as CUDA graphs (``engine.cuda_graphs`` with R rows per sequence): a speculating
engine replays them and gives the tokens the same engine gives with its verify steps eager, and
under ``deterministic`` plain decoding's tokens; rejections roll the KDA state back from the
graph's record.

Drafts are scripted from plain decoding (dummy weights continue no pattern): fully accepted runs
and rejections at chosen positions, over prompts crossing 64-token pages, alone and batched (1 to
4 sequences; 3 pad to 4). With uneven drafts (0 to 3 per sequence, a step's sequences differing)
the graph pads each sequence to the step's longest, and the extra rows are rolled back. Graphed
verify steps roll back through their rollback graphs, eager ones eagerly.

What is asserted equal, and why not more:

- graphed == eager, bit for bit, where both run the same shapes: 1 and 2 sequences with even
  drafts; 4 sequences too under ``deterministic``. Without it, 4 sequences can go uneven on their
  own: once the target's bf16 picks leave plain decoding's, the scripted drafts of one sequence are
  rejected where another's are not, the graph pads the shorter rows, and a step of up to 64
  (token, expert) pairs eagerly (the pair kernels) is over 64 padded (the grouped GEMM), which
  rounds otherwise (the failure seen on the H200 with 4 sequences of 64 tokens; the cause inferred,
  not isolated kernel by kernel).
- graphed == plain decoding under ``deterministic`` only: a verify step computes its rows in
  other shapes than a decode step (R rows a sequence), so without batch invariance its dense GEMMs
  round otherwise, in fp32 too, and the dummy weights' near-tied greedy picks come out otherwise at
  some lengths (measured on the H200: fp32, 1 sequence of 130 tokens, the 25th token). Under
  ``model.deterministic`` a row's kernels do not depend on its step's shape."""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import Request, SamplingParams
from helixserve.testing.drafts import ScriptedDrafter

pytestmark = pytest.mark.gpu

K = 3
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[1 + (i * 37 + 11 * j) % 500 for i in range(length + 9 * j)] for j in range(n)]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-deterministic"])
def engines(request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cache = CacheConfig(memory_budget_mib=4096, max_num_seqs=8)
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3)
    dtype, _, deterministic = request.param.partition("-")
    kw = {"load_format": "dummy", "device": "cuda", "dtype": dtype, "cache": cache,
          "deterministic": bool(deterministic)}
    return request.param, LLM("kimi-k3-mid", **kw), LLM("kimi-k3-mid", speculative=spec, **kw)


class UnevenDrafter(ScriptedDrafter):
    """Scripted drafts, 0 .. K of them by the request's prompt length and output count: a step's
    sequences carry different numbers of drafts (some none), padded to one shape by the graphs."""

    def propose(self, request: Request, budget: int) -> list[int]:
        n = (len(request.prompt_token_ids) + len(request.output_token_ids)) % (K + 1)
        return super().propose(request, budget)[:n]


def _run(llm: LLM, prompts: list[list[int]], script: dict, wrong: set[int], graphs: bool,
         uneven: bool = False) -> tuple[list, int]:
    runner = llm.engine.runner
    kept, runner.verify_graphs = runner.verify_graphs, (runner.verify_graphs if graphs else {})
    kind = UnevenDrafter if uneven else ScriptedDrafter
    llm.engine.scheduler.drafter = kind(K, script, wrong=wrong, vocab_size=llm.model_config.vocab_size)
    replays = sum(g.num_replays + g.num_rollbacks for g in kept.values())
    try:
        tokens = [r.token_ids for r in llm.generate(prompts, PARAMS)]
    finally:
        runner.verify_graphs = kept
    return tokens, sum(g.num_replays + g.num_rollbacks for g in kept.values()) - replays


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [5, 63, 64, 130])
@pytest.mark.parametrize("uneven", [False, True])
def test_gpu_graphed_verify_steps_equal_eager_and_plain(engines, batch: int, length: int, uneven: bool) -> None:
    dtype, plain, spec = engines
    assert sorted(spec.engine.runner.verify_graphs) == list(range(2, K + 2))
    prompts = _prompts(batch, length)
    want = [r.token_ids for r in plain.generate(prompts, PARAMS)]
    script = {tuple(p): t for p, t in zip(prompts, want, strict=True)}
    drafted = spec.engine.spec_stats.num_draft_tokens
    accepted = spec.engine.spec_stats.num_accepted_tokens
    for wrong in (set(), {1}, {0, 2}):
        graphed, replays = _run(spec, prompts, script, wrong, graphs=True, uneven=uneven)
        eager, eager_replays = _run(spec, prompts, script, wrong, graphs=False, uneven=uneven)
        assert replays > 0 and eager_replays == 0, (replays, eager_replays)
        deterministic = dtype.endswith("deterministic")
        if batch != 3 and not uneven and (batch <= 2 or deterministic):  # the same shapes (module docstring)
            assert graphed == eager, (dtype, batch, length, wrong)
        if deterministic:
            assert graphed == want, (batch, length, wrong)
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted  # rejections rolled back
    assert sum(g.num_rollbacks for g in spec.engine.runner.verify_graphs.values()) > 0  # as graphs
