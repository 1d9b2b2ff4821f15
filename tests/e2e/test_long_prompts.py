"""Prompts longer than a step's token budget (chunked prefill), served: router -> ctx -> gen
(dp 1 x cp 2, KV over UCX) answers equal the aggregated ones (the gen world alone, and a
single-process gen worker) through the ``openai`` client, completions and chat (a chat of many
short messages too); a prompt as long as the context is a 400; and ``helixserve generate
--prompt-ids`` with a prompt longer than the default budget.

The deployment's budget is ``scheduler.max_num_batched_tokens = 32`` with 4-token blocks, so the
prompts below end one token before, on, and one token after the budget, and run in several chunks
(up to the context length less ``max_tokens``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from tests.e2e.conftest import MODEL, REPO, Deployment

BUDGET = 32
MAX_MODEL_LEN = 512
MAX_TOKENS = 8
LENGTHS = [BUDGET - 1, BUDGET, BUDGET + 1, 3 * BUDGET + 1, MAX_MODEL_LEN - MAX_TOKENS]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
MANY_MESSAGES = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(36)]


@pytest.fixture(scope="module")
def dep_options() -> dict:
    return {"baseline_gen": True, "scheduler": {"max_num_batched_tokens": BUDGET},
            "cache": {"max_model_len": MAX_MODEL_LEN}}


def complete(client: openai.OpenAI, prompt: list[int], stream: bool = False) -> tuple[str, str | None, dict]:
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump()
    text, finish, usage = "", None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.model_dump()
    return text, finish, usage


def chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, str | None, dict]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **GREEDY)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.model_dump()


def test_long_prompts_disaggregated_equal_aggregated(dep):
    """Each length alone (streamed and not), then all at once (the aggregated workers prefill the
    long prompts in chunks beside the others' decodes)."""
    disagg, world, single = dep.client(), dep.client(dep.gen_url), dep.client(dep.baseline_url)
    for prompt in PROMPTS:
        want = complete(single, prompt)
        assert want[1] == "length" and want[2]["prompt_tokens"] == len(prompt), len(prompt)
        assert want[2]["completion_tokens"] == MAX_TOKENS
        assert complete(disagg, prompt) == want, len(prompt)
        assert complete(disagg, prompt, stream=True) == want, len(prompt)
        assert complete(world, prompt) == want, len(prompt)
    alone = [complete(single, p) for p in PROMPTS]
    for client in (disagg, single):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p, c=client: complete(c, p), PROMPTS)) == alone
    dep_idle(dep)


def test_long_chats_disaggregated_equal_aggregated(dep):
    disagg, single = dep.client(), dep.client(dep.baseline_url)
    long_message = [{"role": "user", "content": "word " * 40}]
    for messages in (long_message, MANY_MESSAGES):
        want = chat(single, messages)
        assert want[2]["prompt_tokens"] > 3 * BUDGET and want[1] == "length"
        assert chat(disagg, messages) == want
    dep_idle(dep)


def test_a_prompt_as_long_as_the_context_is_a_400(dep):
    for client in (dep.client(), dep.client(dep.baseline_url)):
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, _prompt(9, MAX_MODEL_LEN))
        assert (f"maximum context length is {MAX_MODEL_LEN} tokens; the prompt has {MAX_MODEL_LEN} tokens"
                in info.value.message)
    assert complete(dep.client(), PROMPTS[2])[1] == "length"  # the servers go on
    dep_idle(dep)


def dep_idle(dep: Deployment) -> None:
    from tests.e2e.conftest import wait_until

    wait_until(dep.is_idle, 10, "ctx and gen idle")


def test_cli_generate_prompt_longer_than_the_default_budget(k3_tiny):
    """``helixserve generate --prompt-ids`` with 2049 ids (default budget 2048): two chunks."""
    prompt = _prompt(20, SchedulerConfig().max_num_batched_tokens + 1)
    out = subprocess.run(
        [sys.executable, "-m", "helixserve.cli", "generate", "--model", str(k3_tiny), "--prompt-ids",
         ",".join(map(str, prompt)), "--max-tokens", "5", "--ignore-eos", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    one_chunk = LLM(k3_tiny, cache=CacheConfig(max_model_len=4096),
                    scheduler=SchedulerConfig(max_num_batched_tokens=4096))
    from helixserve.engine.request import SamplingParams

    want = one_chunk.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert got["token_ids"] == want.token_ids and got["finish_reason"] == "length"
    assert got["prompt_token_ids"] == prompt
