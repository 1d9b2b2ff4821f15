"""OpenAI-shaped errors: statuses, bodies, pydantic conversion, and the openai client's reading."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ValidationError

from helixserve.protocol import (AuthenticationError, ChatCompletionRequest,
                                 ContextLengthExceededError, GatewayTimeoutError,
                                 InternalServerError, InvalidRequestError, ModelNotFoundError,
                                 NotFoundError, OpenAIError, QueueFullError, RateLimitError,
                                 RequestCancelledError, ServiceUnavailableError,
                                 UnsupportedParameterError, error_body, error_from_body,
                                 parse_model, sse_error, validation_error_to_openai)
from helixserve.protocol.errors import loc_to_param

CASES = [
    (InvalidRequestError("bad"), 400, "invalid_request_error", None),
    (UnsupportedParameterError("no", param="n"), 400, "invalid_request_error",
     "unsupported_parameter"),
    (ContextLengthExceededError("long", param="prompt"), 400, "invalid_request_error",
     "context_length_exceeded"),
    (AuthenticationError("who"), 401, "authentication_error", "invalid_api_key"),
    (NotFoundError("where"), 404, "not_found_error", None),
    (ModelNotFoundError("gpt-9"), 404, "invalid_request_error", "model_not_found"),
    (RateLimitError("slow down"), 429, "rate_limit_error", "rate_limit_exceeded"),
    (QueueFullError("full"), 429, "rate_limit_error", "queue_full"),
    (RequestCancelledError("gone"), 499, "request_cancelled", "request_cancelled"),
    (InternalServerError("bug"), 500, "server_error", "internal_error"),
    (ServiceUnavailableError("ctx worker 0 died"), 503, "service_unavailable_error",
     "service_unavailable"),
    (GatewayTimeoutError("kv transfer timed out"), 504, "timeout_error", "timeout"),
]


@pytest.mark.parametrize("err, status, kind, code", CASES)
def test_error_classes(err, status, kind, code):
    assert isinstance(err, OpenAIError) and err.status_code == status
    body = err.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (kind, code)
    assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("err, status, kind, code", CASES)
def test_error_from_body_round_trip(err, status, kind, code):
    back = error_from_body(status, err.body())
    assert back.status_code == status and back.body() == err.body()
    assert isinstance(back, OpenAIError)


def test_error_from_body_odd_inputs():
    err = error_from_body(502, "<html>bad gateway</html>")
    assert err.status_code == 502 and "bad gateway" in err.message
    assert isinstance(err, InternalServerError)
    err = error_from_body(418, {"error": {"message": "teapot", "param": 3}})
    assert (err.status_code, err.message, err.param) == (418, "teapot", None)
    assert isinstance(error_from_body(404, {"error": {"message": "m"}}), NotFoundError)


def test_model_not_found_names_model():
    err = ModelNotFoundError("gpt-9")
    assert err.param == "model" and "gpt-9" in err.message


def test_error_body_and_sse_error():
    assert error_body("m", "invalid_request_error", "p", "c") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}}
    event = sse_error(ServiceUnavailableError("gen worker died"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):])["error"]["code"] == "service_unavailable"


def test_loc_to_param():
    assert loc_to_param(("messages", 0, "content")) == "messages[0].content"
    assert loc_to_param(("stop_token_ids", 2)) == "stop_token_ids[2]"
    assert loc_to_param(("a", "b")) == "a.b" and loc_to_param(()) is None


def test_validation_error_conversion_on_a_plain_model():
    class Plain(BaseModel):
        count: int

    with pytest.raises(ValidationError) as info:
        Plain.model_validate({"count": "many"})
    err = validation_error_to_openai(info.value)
    assert (err.status_code, err.param, err.code) == (400, "count", "invalid_type")
    assert "count" in err.message


def test_nested_validation_error_names_the_path():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user",
                                                                          "content": 5}]})
    assert validation_error_to_openai(info.value).param == "messages[1].content"


@pytest.mark.parametrize("raw", [b"{not json", "", b"\xff\xfe", "[1, 2]", "null", '"str"'])
def test_parse_model_rejects_non_objects(raw):
    with pytest.raises(InvalidRequestError) as info:
        parse_model(ChatCompletionRequest, raw)
    assert info.value.status_code == 400 and info.value.code == "invalid_json"


def test_openai_client_maps_our_statuses():
    openai = pytest.importorskip("openai")
    httpx2 = pytest.importorskip("httpx2")
    expected = {401: openai.AuthenticationError, 404: openai.NotFoundError,
                429: openai.RateLimitError, 500: openai.InternalServerError,
                503: openai.InternalServerError, 504: openai.InternalServerError}
    for err, status, _, code in CASES:
        if status not in expected:
            continue
        transport = httpx2.MockTransport(
            lambda request, err=err: httpx2.Response(err.status_code, json=err.body()))
        client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0,
                               http_client=httpx2.Client(transport=transport))
        with pytest.raises(expected[status]) as info:
            client.models.list()
        assert (info.value.status_code, info.value.code) == (status, code)
        assert err.message in info.value.message
