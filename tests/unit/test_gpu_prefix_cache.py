"""Prefix caching on the GPU: what a cache hit computes against what the first run computed.

- The KDA layers of a prefill chunk with checkpoints run in segments cut at the checkpoint
  positions (:mod:`helixserve.models.kda_checkpoints`): on the GPU the short conv and the chunked
  KDA over segments cut at 64-token multiples equal one call over the whole chunk bit for bit, in
  bf16 (fla's kernels) and fp32.
- ``kimi-k3-mid`` in fp32 (dummy weights): a repeated request that resumes from a cached prefix
  gives the first run's greedy tokens (the restored MLA pages and KDA states are the ones the
  first run computed). In bf16 a hit computes fewer rows per step than the first run, which
  rounds differently (docs/benchmarks.md, "Why cache.prefix_caching is off by default").
"""

from __future__ import annotations

import pytest
import torch

from helixserve import kernels
from helixserve.config import CacheConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _segment(qkv, weight, g, beta, rows: slice, conv, state, heads: int, dim: int):  # noqa: ANN001, ANN202
    n = rows.stop - rows.start
    cu = torch.tensor([0, n], device=qkv.device)
    x, conv_at = kernels.short_conv_prefill(qkv[rows], weight, conv_state=conv, cu_seqlens=cu, activation="silu")
    q, k, v = (t.reshape(n, heads, dim) for t in x.split(heads * dim, dim=-1))
    out, state_at = kernels.kda_chunk_prefill(q, k, v, g[rows], beta[rows], scale=dim**-0.5, initial_state=state,
                                              cu_seqlens=cu, use_qk_l2norm=True)
    return x, out, conv_at, state_at


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "cut"), [(300, 256), (1000, 960), (130, 64), (65, 64)])
def test_kda_segments_cut_at_chunk_multiples_equal_one_call_bit_for_bit(dtype, rows, cut):
    torch.manual_seed(rows)
    heads, dim, width, dev = 16, 128, 4, "cuda"
    qkv = torch.randn(rows, 3 * heads * dim, device=dev, dtype=dtype)
    weight = torch.randn(3 * heads * dim, width, device=dev, dtype=dtype) * 0.3
    g = -torch.rand(rows, heads, dim, device=dev) * 0.1
    beta = torch.rand(rows, heads, device=dev, dtype=dtype)
    conv0 = torch.zeros(1, 3 * heads * dim, width - 1, device=dev, dtype=dtype)
    state0 = torch.zeros(1, heads, dim, dim, device=dev)
    whole = _segment(qkv, weight, g, beta, slice(0, rows), conv0, state0, heads, dim)
    first = _segment(qkv, weight, g, beta, slice(0, cut), conv0, state0, heads, dim)
    second = _segment(qkv, weight, g, beta, slice(cut, rows), first[2].to(dtype), first[3].float(), heads, dim)
    assert torch.equal(whole[0], torch.cat([first[0], second[0]]))  # the conv's output
    assert torch.equal(whole[1], torch.cat([first[1], second[1]]))  # the KDA output
    assert torch.equal(whole[2], second[2]) and torch.equal(whole[3], second[3])  # the states after


def test_fp32_mid_a_cache_hit_gives_the_first_runs_tokens():
    """Prompts whose repeat resumes at their last full block: one token, 12 and 8 tokens to compute."""
    llm = LLM("kimi-k3-mid", load_format="dummy", device="cuda", dtype="float32",
              cache=CacheConfig(memory_budget_mib=2048, prefix_caching=True))
    manager = llm.engine.cache_manager
    for n in (65, 300, 1000):
        prompt = [(7 * i + n) % 500 for i in range(n)]  # no prompt a prefix of another
        first = llm.generate([prompt], GREEDY)[0].token_ids
        hits = manager.prefix_stats.num_hit_tokens
        again = llm.generate([prompt], GREEDY)[0].token_ids
        size = manager.tokens_per_block
        assert manager.prefix_stats.num_hit_tokens - hits == (n - 1) // size * size  # it resumed there
        assert again == first, (n, first, again)
