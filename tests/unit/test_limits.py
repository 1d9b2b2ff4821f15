"""Request limits on a worker (no engine needed): prompt tokens at -1 / 0 / +1, refusal by byte
count before tokenizing where the tokenizer proves a bound, and tokenization that leaves the event
loop running (the work a large request brings runs in the :class:`OffLoop` pool)."""

from __future__ import annotations

import asyncio
import random

import pytest

from helixserve.config import DeploymentConfig, LimitsConfig
from helixserve.models.tokenizer import SPECIAL_TOKENS
from helixserve.models.tokenizer_hf import write_tokenizer_files
from helixserve.models.tokenizer_loader import load_tokenizer
from helixserve.protocol import (ChatCompletionRequest, CompletionRequest,
                                 ContextLengthExceededError, parse_model)
from helixserve.serving.http import OffLoop
from helixserve.serving.openai_serving import ServingLimits, max_bytes_per_token, prepare

MODEL = "m"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out)
    return load_tokenizer(out)


def _limits(tok, max_prompt_tokens: int, bound: int | None = -1) -> ServingLimits:
    return ServingLimits(served_model=MODEL, max_model_len=max_prompt_tokens + 16,
                         vocab_size=tok.vocab_size,
                         default_max_tokens=4, max_prompt_tokens=max_prompt_tokens,
                         max_body_bytes=1 << 20,
                         max_bytes_per_token=max_bytes_per_token(tok) if bound == -1 else bound)


def _completion(prompt) -> CompletionRequest:
    return parse_model(CompletionRequest, {"model": MODEL, "prompt": prompt, "max_tokens": 1})


def test_limits_config_defaults_and_bounds():
    limits = DeploymentConfig.model_validate({"model": {"path": "/x"}}).limits
    assert limits == LimitsConfig(max_body_bytes=4 * 1024 * 1024, max_prompt_tokens=None)
    with pytest.raises(ValueError):
        LimitsConfig(max_prompt_tokens=0)
    with pytest.raises(ValueError):
        LimitsConfig(max_body_bytes=10)


def test_byte_tokenizer_bound_holds_for_any_text(tok):
    bound = max_bytes_per_token(tok)
    assert bound is not None and bound >= max(len(s.encode()) for s in SPECIAL_TOKENS)
    rng = random.Random(0)
    pieces = ["a", "é", "€", "😀", " ", "\n", *SPECIAL_TOKENS]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 64)))
        assert len(tok.encode(text)) >= -(-len(text.encode()) // bound), text


@pytest.mark.parametrize("bound", [-1, None], ids=["byte-bound", "no-bound"])
def test_max_prompt_tokens_minus_one_at_plus_one(tok, bound):
    limits = _limits(tok, 32, bound)
    for n in (31, 32):
        assert len(prepare("r", _completion("z" * n), tok, limits).prompt_token_ids) == n
        assert len(prepare("r", _completion(list(range(n))), tok, limits).prompt_token_ids) == n
    for prompt in ("z" * 33, list(range(33))):
        with pytest.raises(ContextLengthExceededError, match="at most 32 prompt tokens") as err:
            prepare("r", _completion(prompt), tok, limits)
        assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_before_tokenizing(tok):
    limits = _limits(tok, 32)
    big = "q" * 4_000_000
    with pytest.raises(ContextLengthExceededError, match="at least") as err:
        prepare("r", _completion(big), tok, limits)
    assert err.value.param == "prompt"
    chat = parse_model(ChatCompletionRequest, {"model": MODEL, "messages": [
        {"role": "user", "content": big}]})
    with pytest.raises(ContextLengthExceededError, match="at least") as err:
        prepare("r", chat, tok, limits)
    assert err.value.param == "messages"


def test_tokenizing_in_the_pool_leaves_the_event_loop_running(tok):
    """A 1.2 MB prompt takes the tokenizer a good part of a second; meanwhile a heartbeat
    coroutine on the loop keeps ticking (it would not, were the tokenizer holding the GIL or
    running on the loop)."""
    text = "hello world " * 100_000
    limits = _limits(tok, 10_000_000, bound=None)

    async def main() -> tuple[int, int]:
        pool = OffLoop("test")
        ticks = 0
        done = False

        async def heartbeat() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.005)

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0)
        before = ticks
        try:
            prepared = await pool.run(prepare, "r", _completion(text), tok, limits)
        finally:
            done = True
            await beat
            pool.shutdown()
        return len(prepared.prompt_token_ids), ticks - before

    num_tokens, ticks = asyncio.run(main())
    assert num_tokens == len(text)
    assert ticks >= 5, ticks
