"""Nothing compiles after ``/ready``: an engine warmed as a worker warms itself
(:func:`~helixserve.serving.warm_up.warm_up_prompts`, alone and batched) compiles no Triton kernel
(ours or fla's) for prompts of any length in 1..4096, alone or beside another request.

Counted through Triton's JIT compile hook (``triton.knobs.runtime.jit_post_compile_hook``: called
once per kernel variant compiled, never on a cache hit). ``kimi-k3-mid`` with dummy weights, bf16."""

from __future__ import annotations

import pytest

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.serving.warm_up import warm_up_prompts

pytestmark = pytest.mark.gpu
# every length class Triton tells apart (== 1, % 16 == 0, neither) and the page / chunk edges
LENGTHS = sorted({1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 500,
                  511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 3000, 4095, 4096})


@pytest.fixture
def compilations():
    triton = pytest.importorskip("triton")
    compiled: list[str] = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        compiled.append(str(getattr(fn, "name", fn)))
        return None

    runtime = triton.knobs.runtime
    before = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = hook
    yield compiled
    runtime.jit_post_compile_hook = before


def _assert_the_hook_counts(compilations: list[str]) -> None:
    """A kernel variant this process has not compiled (a new block size) is seen by the hook; the
    warm-up's own compilations may have happened earlier in this process (other tests)."""
    import torch

    from tests.unit._triton_probe import fill_kernel, fresh_block  # (needs Triton: GPU machines only)

    compilations.clear()
    block = fresh_block()
    out = torch.empty(block, device="cuda")
    fill_kernel[(1,)](out, 2.0, BLOCK=block)
    assert compilations and bool((out == 2.0).all()), "the hook saw no compilation: it is not counting"
    compilations.clear()


def _warm_as_a_worker(llm: LLM, sched: SchedulerConfig, compilations: list[str]) -> None:
    """Run the worker's warm-up requests (alone and batched), then check the hook counts."""
    layout = llm.engine.layout
    for prompt, params, copies in warm_up_prompts(layout.max_model_len, layout.max_model_len,
                                                  llm.model_config.vocab_size, layout.tokens_per_block,
                                                  sched.max_num_batched_tokens):
        llm.generate([prompt] * copies, params)
    _assert_the_hook_counts(compilations)


def test_gpu_no_triton_compilation_after_warm_up(compilations):
    cache, sched = CacheConfig(memory_budget_mib=8192, max_num_seqs=16), SchedulerConfig()
    llm = LLM("kimi-k3-mid", load_format="dummy", device="cuda", cache=cache, scheduler=sched)
    _warm_as_a_worker(llm, sched, compilations)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for n in LENGTHS:
        prompt = [1 + (i * 31) % 500 for i in range(n)]
        llm.generate([prompt], params)
        llm.generate([prompt, [7] * (n % 37 + 1)], params)
        assert not compilations, f"a prompt of {n} tokens compiled {compilations}"


def test_gpu_no_triton_compilation_after_warm_up_with_speculation(compilations):
    """A speculating engine (k = 3) warmed as its worker warms itself compiles nothing when its
    first verify steps run: drafts accepted and rejected (scripted from plain decoding: dummy
    weights continue no pattern), one sequence or several, beside a prompt's prefill."""
    from helixserve.config_speculative import SpeculativeConfig
    from helixserve.testing.drafts import ScriptedDrafter

    cache, sched = CacheConfig(memory_budget_mib=8192, max_num_seqs=16), SchedulerConfig()
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM("kimi-k3-mid", load_format="dummy", device="cuda", cache=cache, scheduler=sched, speculative=spec)
    _warm_as_a_worker(llm, sched, compilations)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    scheduler = llm.engine.scheduler
    for n in (5, 17, 64, 300, 1000):
        prompts = [[1 + (i * 31 + j) % 500 for i in range(n)] for j in range(3)]
        drafter, scheduler.drafter = scheduler.drafter, None
        plain = llm.generate(prompts, params)  # (decode steps the warm-up covers)
        script = {tuple(p): r.token_ids for p, r in zip(prompts, plain, strict=True)}
        scheduler.drafter = ScriptedDrafter(3, script, wrong={1}, vocab_size=llm.model_config.vocab_size)
        drafted = llm.engine.spec_stats.num_draft_tokens
        got = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
        scheduler.drafter = drafter
        assert llm.engine.spec_stats.num_draft_tokens > drafted, "nothing was drafted: no verify step ran"
        assert not compilations, f"speculating requests of {n} tokens compiled {sorted(set(compilations))}"
        assert len(got) == 3
