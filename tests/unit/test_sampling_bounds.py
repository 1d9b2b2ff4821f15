"""Every sampling parameter is bounded where it enters: the OpenAI request models (a 400 naming the
parameter and the value), ``SamplingParams`` (the Python API and ``helixserve generate``: a
``ValidationError`` naming the field and the value), and the sampler (a ``top_k`` above the
vocabulary keeps every token). Limits at -1 / 0 / +1."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from helixserve.cli import main
from helixserve.engine.request import INT32_MAX, SamplingParams
from helixserve.engine.sampler import sample_on_device
from helixserve.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequestError
from helixserve.protocol.errors import parse_model

# (parameter, refused value as JSON text, a message part); each also refused in a chat request
REFUSED = [
    ("top_k", "9223372036854775808", "less than or equal to 2147483647 (got 9223372036854775808)"),
    ("top_k", "1e30", "less than or equal to 2147483647"),
    ("top_k", "2147483648", "less than or equal to 2147483647 (got 2147483648)"),
    ("top_k", "-2", "greater than or equal to -1 (got -2)"),
    ("top_k", "1e999", "expected an integer, got inf"),
    ("max_tokens", "2147483648", "less than or equal to 2147483647"),
    ("max_tokens", "0", "greater than or equal to 1"),
    ("temperature", "1e999", "finite number"),
    ("temperature", "2.0000001", "less than or equal to 2"),
    ("temperature", "-1e-300", "greater than or equal to 0"),
    ("top_p", "1e999", "finite number"),
    ("top_p", "0", "greater than 0"),
    ("top_p", "1.0000001", "less than or equal to 1"),
    ("seed", "18446744073709551616", "less than 18446744073709552000"),
    ("seed", "-9223372036854775809", "greater than or equal to -9223372036854775808"),
    ("presence_penalty", "1e999", "only 0 is supported"),
    ("frequency_penalty", "-2", "only 0 is supported"),
    ("n", "2147483648", "only n=1 is supported"),
    ("logit_bias", '{"1": 1e999}', "logit_bias is not supported"),
]
ACCEPTED = [("top_k", 2147483647), ("top_k", -1), ("top_k", 0), ("top_k", 1), ("max_tokens", 2147483647),
            ("temperature", 2), ("temperature", 0), ("top_p", 1), ("top_p", 5e-324),
            ("seed", 2**64 - 1), ("seed", -(2**63))]


def _body(endpoint: str, name: str, raw: str) -> bytes:
    head = '"prompt": "hi"' if endpoint == "completions" else '"messages": [{"role": "user", "content": "hi"}]'
    return f'{{"model": "m", {head}, "{name}": {raw}}}'.encode()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("name", "raw", "message"), REFUSED, ids=[f"{n}={r}" for n, r, _ in REFUSED])
def test_out_of_range_parameters_are_a_400_naming_them(endpoint, name, raw, message):
    cls = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    with pytest.raises(InvalidRequestError) as err:
        parse_model(cls, _body(endpoint, name, raw))
    assert err.value.status_code == 400 and err.value.param == name, err.value
    assert message in str(err.value), err.value


@pytest.mark.parametrize(("name", "value"), ACCEPTED, ids=[f"{n}={v}" for n, v in ACCEPTED])
def test_parameters_at_their_limits_are_accepted_by_the_api_and_the_engine(name, value):
    body = parse_model(CompletionRequest, _body("completions", name, json.dumps(value)))
    assert getattr(body, name) == value
    assert getattr(SamplingParams(**{name: value}), name) == value


ENGINE_REFUSED = [("top_k", 2**63), ("top_k", 2**31), ("top_k", -2), ("max_tokens", 2**31), ("max_tokens", 0),
                  ("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", float("nan")),
                  ("temperature", float("inf")), ("temperature", -1e-300), ("top_p", float("nan")), ("top_p", 0.0),
                  ("stop_token_ids", (2**31,)), ("stop_token_ids", (-1,)), ("top_k", 1.5)]


@pytest.mark.parametrize(("name", "value"), ENGINE_REFUSED, ids=[f"{n}={v}" for n, v in ENGINE_REFUSED])
def test_sampling_params_refuse_what_the_engine_cannot_run_naming_field_and_value(name, value):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{name: value})
    (error,) = err.value.errors()
    assert error["loc"][0] == name
    shown = value[0] if isinstance(value, tuple) else value
    assert str(shown) in str(err.value), err.value


def test_helixserve_generate_refuses_a_top_k_past_int32_naming_it(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--top-k", str(2**63)]) == 2
    err = capsys.readouterr().err
    assert "top_k" in err and str(2**63) in err


@pytest.mark.parametrize("top_k", [99, 100, 101, INT32_MAX])
def test_a_top_k_at_or_above_the_vocabulary_keeps_every_token(top_k):
    """Vocabulary 100 of equal logits: top_k 99 drops a token; 100, 101 and 2**31 - 1 sample as
    top_k off."""
    logits = torch.zeros(4, 100)
    params = [SamplingParams(temperature=1.5, top_k=top_k, seed=1)] * 4
    off = [SamplingParams(temperature=1.5, top_k=0, seed=1)] * 4

    def draw(ps: list[SamplingParams]) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        return torch.stack([sample_on_device(logits, ps, gens) for _ in range(100)])

    same = torch.equal(draw(params), draw(off))
    assert same is (top_k >= 100)
