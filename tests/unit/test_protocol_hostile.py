"""Hostile request bodies at the protocol layer: strict JSON (a 400 ``invalid_json`` for what no
UTF-8 hop could re-encode, non-standard numbers, or nesting too deep to parse), integral floats
for integer parameters, and the headers some errors carry (429 ``Retry-After``, 413)."""

from __future__ import annotations

import json

import pytest

from helixserve.protocol import (ChatCompletionRequest, CompletionRequest, InvalidRequestError,
                                 PayloadTooLargeError, QueueFullError, RateLimitError,
                                 error_from_body, parse_json, parse_model, raw_prompt_length)

DEEP = 100_000


def body(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "\\ud800"}',
    b'{"model": "m", "prompt": "x\\udfff"}',
    b'{"model": "m", "prompt": "\\udc00\\ud800"}',  # reversed pair
    b'{"model": "m", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b'{"model": "m", "user": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
    b'{"model": "m", "prompt": "hi", "temperature": NaN}',
    b'{"model": "m", "prompt": "hi", "temperature": -Infinity}',
    b'{"model": "m", "prompt": "\xff"}',
    b'{"model": "m", "prompt": "hi"',
    b"",
], ids=["lone-high", "lone-low", "reversed-pair", "deep-array", "deep-object", "nan", "-inf",
        "bad-utf8", "truncated", "empty"])
def test_hostile_json_is_a_400_invalid_json(raw):
    for cls in (CompletionRequest, ChatCompletionRequest):
        with pytest.raises(InvalidRequestError) as err:
            parse_model(cls, raw)
        assert (err.value.status_code, err.value.code) == (400, "invalid_json")
        assert err.value.message.startswith("The request body is not valid JSON")


def test_a_valid_surrogate_pair_and_whatever_parses_re_encodes():
    raw = b'{"model": "m", "prompt": "\\ud83d\\ude00 ok", "temperature": 1e-3}'
    obj = parse_json(raw)
    assert obj["prompt"] == "\N{GRINNING FACE} ok"
    json.dumps(obj, allow_nan=False).encode("utf-8")  # what the router sends on its hop
    assert parse_model(CompletionRequest, raw).prompt == "\N{GRINNING FACE} ok"


@pytest.mark.parametrize("name", ["top_k", "max_tokens", "seed"])
def test_integer_parameters_accept_integral_floats(name):
    assert getattr(parse_model(CompletionRequest, body(**{name: 76.0})), name) == 76
    assert type(getattr(parse_model(CompletionRequest, body(**{name: 76.0})), name)) is int
    with pytest.raises(InvalidRequestError) as err:
        parse_model(CompletionRequest, body(**{name: 76.5}))
    assert (err.value.param, err.value.code) == (name, "invalid_type")
    assert "76.5" in err.value.message
    for bad in (True, "76"):
        with pytest.raises(InvalidRequestError) as err:
            parse_model(CompletionRequest, body(**{name: bad}))
        assert err.value.param == name


def test_chat_max_completion_tokens_accepts_an_integral_float():
    req = parse_model(ChatCompletionRequest, {"model": "m", "max_completion_tokens": 8.0,
                                              "messages": [{"role": "user", "content": "x"}]})
    assert req.max_new_tokens == 8
    with pytest.raises(InvalidRequestError):
        parse_model(CompletionRequest, body(max_tokens=0.0))  # still >= 1


def test_rate_limit_errors_say_when_to_retry():
    for err in (RateLimitError("slow"), QueueFullError("full"),
                error_from_body(429, QueueFullError("full").body())):
        assert err.status_code == 429 and int(err.headers["Retry-After"]) >= 1
    assert InvalidRequestError("x").headers == {}
    assert InvalidRequestError("x", headers={"Allow": "POST"}).headers == {"Allow": "POST"}


def test_payload_too_large_round_trips():
    err = PayloadTooLargeError("too big")
    assert (err.status_code, err.code, err.error_type) == (413, "request_too_large",
                                                          "invalid_request_error")
    back = error_from_body(413, err.body())
    assert isinstance(back, PayloadTooLargeError) and back.body() == err.body()


def test_raw_prompt_length_reads_only_token_id_lists():
    assert raw_prompt_length({"prompt": list(range(70))}) == 70
    for raw in ({"prompt": "x" * 70}, {"prompt": [[1, 2, 3]]}, {"prompt": ["a", "b"]},
                {"prompt": []}, {"prompt": [True]}, {}, [1, 2, 3], None):
        assert raw_prompt_length(raw) is None, raw
