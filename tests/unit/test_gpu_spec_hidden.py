"""The hidden-state drafter (``speculative.method: hidden``) on the GPU: greedy speculative decoding
gives plain decoding's tokens on CUDA in fp32 for both tiny presets (a random drafter, nothing
accepted; and forced drafts, whole runs accepted), the target's decode steps eager."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # fp32 dots in fla exact, like the reference

from helixserve.config import CacheConfig  # noqa: E402
from helixserve.config_speculative import SpeculativeConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.models.presets import make_checkpoint  # noqa: E402
from helixserve.testing.drafts import record_drafts  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = [list(range(20, 41)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [(7 * i) % 250 for i in range(40)]]


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_hidden_greedy_equals_plain_decoding_on_cuda(tiny_checkpoints, tmp_path, preset):
    drafter = make_checkpoint(f"{preset}-hidden", tmp_path / "hidden", seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 9, 20)]
    cache = CacheConfig(tokens_per_block=16, max_num_seqs=8)
    plain = LLM(tiny_checkpoints[preset], dtype="float32", device="cuda", cache=cache)
    ref = [r.token_ids for r in plain.generate(PROMPTS, params)]
    spec = SpeculativeConfig(method="hidden", draft_model=drafter, num_draft_tokens=3)
    for forced in (False, True):
        llm = LLM(tiny_checkpoints[preset], dtype="float32", device="cuda", cache=cache, speculative=spec)
        if forced:  # the drafter runs, then its drafts are replaced by plain decoding's next tokens
            record_drafts(llm.engine, {tuple(p): r for p, r in zip(PROMPTS, ref)})
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == ref
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 0 and llm.engine.runner.decode_graphs is None
        if forced:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
