"""OpenAI request/response models: parsing, validation errors, and the ``openai`` client as oracle.

The ``openai`` package is the independent check: its own pydantic types must accept our response
JSON, and its HTTP client (over an in-memory transport) must accept our non-streamed answers, our
SSE streams and our error bodies, while our models must accept the requests it sends.
"""

from __future__ import annotations

import json

import pytest

from helixserve.protocol import (SSE_DONE, ChatCompletionRequest, CompletionRequest,
                                 ContextLengthExceededError, FinishReason, InvalidRequestError,
                                 ModelCard, ModelList, ModelNotFoundError, OpenAIError,
                                 RequestCancelledError, ResponseMeta, Usage, chat_completion_chunk,
                                 chat_completion_response, chat_usage_chunk, completion_chunk,
                                 completion_response, completion_usage_chunk, parse_model,
                                 resolve_max_tokens, sse_event, to_openai_finish_reason)

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the HTTP library of the installed openai client

MODEL = "kimi-k3-tiny"
PIECES = ["Hel", "lo", ", hel", "ix"]


def completion_body(**over):
    return {"model": MODEL, "prompt": "Hello", **over}


def chat_body(**over):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **over}


# ---------------------------------------------------------------- requests


def test_completion_request_round_trip():
    body = completion_body(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3,
                           stop=["\n", "END"], stop_token_ids=[2], ignore_eos=True, stream=True,
                           stream_options={"include_usage": True}, user="u1")
    req = parse_model(CompletionRequest, json.dumps(body))
    dumped = req.model_dump(exclude_none=True)
    assert dumped == body
    assert parse_model(CompletionRequest, req.model_dump_json()) == req
    assert req.include_usage and req.stop_strings == ["\n", "END"] and req.max_new_tokens == 8


def test_chat_request_round_trip():
    body = chat_body(messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello."},
                               {"role": "user", "content": "More"}],
                     max_completion_tokens=5, temperature=0, stop="x")
    req = parse_model(ChatCompletionRequest, body)
    assert req.stop == ["x"] and req.max_new_tokens == 5 and not req.include_usage
    assert parse_model(ChatCompletionRequest, req.model_dump_json()) == req


@pytest.mark.parametrize("prompt, expected", [
    ("Hello", "Hello"), ([1, 2, 3], [1, 2, 3]), (["Hello"], "Hello"), ([[4, 5]], [4, 5]),
])
def test_prompt_forms(prompt, expected):
    assert parse_model(CompletionRequest, completion_body(prompt=prompt)).prompt == expected


def test_chat_content_parts_and_developer_role():
    req = parse_model(ChatCompletionRequest, chat_body(messages=[
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]))
    assert [(m.role, m.content) for m in req.messages] == [("system", "rules"), ("user", "a\nb")]


@pytest.mark.parametrize("extra", [
    {"n": 1}, {"n": None}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"logit_bias": {}},
    {"logprobs": None}, {"best_of": 1}, {"echo": False}, {"suffix": ""},
])
def test_neutral_unsupported_values_are_accepted(extra):
    req = parse_model(CompletionRequest, completion_body(**extra))
    assert not set(extra) & set(req.model_dump())


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"tools": []}, {"tool_choice": "none"}, {"store": False},
    {"response_format": {"type": "text"}}, {"max_tokens": 4, "max_completion_tokens": 4},
])
def test_chat_neutral_values_are_accepted(extra):
    parse_model(ChatCompletionRequest, chat_body(**extra))


BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -3}, "max_tokens", "invalid_value"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"temperature": 2.01}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": True}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"top_k": -2}, "top_k", "invalid_value"),
    ({"seed": "1"}, "seed", "invalid_type"),
    ({"seed": 2**64}, "seed", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [1, -1]}, "prompt", "invalid_value"),
    ({"prompt": 7}, "prompt", "invalid_type"),
    ({"prompt": [1, "a"]}, "prompt", "invalid_type"),
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({"prompt": [[1], [2]]}, "prompt", "unsupported_parameter"),
    ({"model": ""}, "model", "invalid_value"),
    ({"model": 3}, "model", "invalid_type"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": 3}, "stop", "invalid_value"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value"),
    ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"stream": 1}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown_parameter"),
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"logprobs": 0}, "logprobs", "unsupported_parameter"),
    ({"logprobs": 5}, "logprobs", "unsupported_parameter"),
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_parameter"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    ({"min_tokens": 3}, "min_tokens", "unknown_parameter"),
    ({"prompt": None}, "prompt", "invalid_type"),
]


@pytest.mark.parametrize("over, param, code", BAD_COMPLETIONS)
def test_bad_completion_requests_name_the_param(over, param, code):
    body = completion_body(**over)
    with pytest.raises(InvalidRequestError) as info:
        parse_model(CompletionRequest, json.dumps(body))
    err = info.value
    assert err.status_code == 400 and err.param == param and err.code == code, err.body()
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": code}}
    assert err.message


def test_missing_prompt_and_model():
    for body, param in ([{"model": MODEL}, "prompt"], [{"prompt": "x"}, "model"]):
        with pytest.raises(InvalidRequestError) as info:
            parse_model(CompletionRequest, body)
        assert (info.value.param, info.value.code) == (param, "missing_required_parameter")


BAD_CHATS = [
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[1].content", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "a", "name": "bob"}]}, "messages[0].name",
     "unknown_parameter"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "invalid_value"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "unsupported_parameter"),
    ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"n": 3}, "n", "unsupported_parameter"),
    ({"prompt": "x"}, "prompt", "unknown_parameter"),
    ({"temperature": 5}, "temperature", "invalid_value"),
]


@pytest.mark.parametrize("over, param, code", BAD_CHATS)
def test_bad_chat_requests_name_the_param(over, param, code):
    with pytest.raises(InvalidRequestError) as info:
        parse_model(ChatCompletionRequest, chat_body(**over))
    assert (info.value.status_code, info.value.param, info.value.code) == (400, param, code), \
        info.value.body()


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(None, 10, 100, default=16) == 16
    assert resolve_max_tokens(None, 95, 100, default=16) == 5
    assert resolve_max_tokens(90, 10, 100) == 90
    with pytest.raises(ContextLengthExceededError) as info:
        resolve_max_tokens(91, 10, 100)
    assert (info.value.status_code, info.value.param) == (400, "max_tokens")
    with pytest.raises(ContextLengthExceededError) as info:
        resolve_max_tokens(None, 100, 100, prompt_param="messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"


# ---------------------------------------------------------------- responses vs openai's types


def test_finish_reason_mapping():
    assert to_openai_finish_reason(FinishReason.STOP) == "stop"
    assert to_openai_finish_reason("length") == "length"
    assert to_openai_finish_reason(None) is None
    with pytest.raises(RequestCancelledError) as info:
        to_openai_finish_reason(FinishReason.ABORT)
    assert info.value.status_code == 499
    with pytest.raises(ValueError):
        to_openai_finish_reason("eos")
    with pytest.raises(ValueError):
        completion_response(ResponseMeta.for_completion(MODEL), "x", None, Usage.of(1, 1))


def test_ids_and_usage():
    c, ch = ResponseMeta.for_completion(MODEL), ResponseMeta.for_chat(MODEL, created=5)
    assert c.id.startswith("cmpl-") and len(c.id) == 5 + 32 and ch.id.startswith("chatcmpl-")
    assert ch.created == 5 and c.id != ResponseMeta.for_completion(MODEL).id
    assert Usage.of(3, 4).total_tokens == 7
    with pytest.raises(ValueError):
        Usage(prompt_tokens=1, completion_tokens=1, total_tokens=3)
    with pytest.raises(ValueError):
        Usage.of(-1, 2)


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_completion_response_parses_as_openai_completion(reason):
    resp = completion_response(ResponseMeta.for_completion(MODEL), "Hello", reason, Usage.of(3, 2))
    theirs = openai.types.Completion.model_validate(json.loads(resp.model_dump_json()))
    assert theirs.choices[0].text == "Hello" and theirs.choices[0].finish_reason == reason
    assert theirs.usage.total_tokens == 5 and theirs.object == "text_completion"
    assert theirs.id == resp.id and theirs.created == resp.created and theirs.model == MODEL


def test_completion_chunks_parse_as_openai_completion():
    meta = ResponseMeta.for_completion(MODEL)
    last = completion_chunk(meta, "!", FinishReason.LENGTH)
    theirs = openai.types.Completion.model_validate(json.loads(last.model_dump_json()))
    assert theirs.choices[0].finish_reason == "length" and theirs.usage is None
    usage = openai.types.Completion.model_validate_json(
        completion_usage_chunk(meta, Usage.of(2, 1)).model_dump_json())
    assert usage.choices == [] and usage.usage.completion_tokens == 1
    middle = json.loads(completion_chunk(meta, "Hel").model_dump_json())
    assert middle["choices"][0]["finish_reason"] is None and "usage" not in middle


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_chat_response_parses_as_openai_chat_completion(reason):
    resp = chat_completion_response(ResponseMeta.for_chat(MODEL), "Hi!", reason, Usage.of(7, 3))
    theirs = openai.types.chat.ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert theirs.choices[0].message.content == "Hi!" and theirs.choices[0].message.role == \
        "assistant"
    assert theirs.choices[0].finish_reason == reason and theirs.usage.prompt_tokens == 7
    assert theirs.object == "chat.completion"


def test_chat_chunks_parse_as_openai_chat_completion_chunk():
    meta = ResponseMeta.for_chat(MODEL)
    chunks = [chat_completion_chunk(meta, "", is_first=True), chat_completion_chunk(meta, "Hi"),
              chat_completion_chunk(meta, finish_reason="stop"),
              chat_usage_chunk(meta, Usage.of(4, 1))]
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(json.loads(c.model_dump_json()))
              for c in chunks]
    first = parsed[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    assert parsed[1].choices[0].delta.content == "Hi" and parsed[1].choices[0].delta.role is None
    assert parsed[2].choices[0].finish_reason == "stop"
    assert json.loads(chunks[2].model_dump_json())["choices"][0]["delta"] == {}
    assert parsed[3].choices == [] and parsed[3].usage.total_tokens == 5
    assert {p.id for p in parsed} == {meta.id} and {p.created for p in parsed} == {meta.created}


def test_model_list_parses_as_openai_model():
    models = ModelList(data=[ModelCard(id=MODEL, created=1)])
    theirs = openai.types.Model.model_validate(json.loads(models.model_dump_json())["data"][0])
    assert (theirs.id, theirs.object, theirs.owned_by) == (MODEL, "model", "helixserve")


def test_response_round_trip():
    resp = chat_completion_response(ResponseMeta.for_chat(MODEL), "x", "stop", Usage.of(1, 1))
    assert type(resp).model_validate_json(resp.model_dump_json()) == resp


def test_sse_event_format():
    event = sse_event(completion_chunk(ResponseMeta.for_completion(MODEL), "a"))
    assert event.startswith("data: {") and event.endswith("}\n\n")
    assert SSE_DONE == "data: [DONE]\n\n"


# ---------------------------------------------------------------- the openai HTTP client end to end


class FakeServer:
    """An in-memory server built only from helixserve.protocol; records the requests it parsed."""

    def __init__(self):
        self.requests = []

    def __call__(self, request):
        try:
            return self._handle(request)
        except OpenAIError as err:
            return httpx2.Response(err.status_code, json=err.body())

    def _handle(self, request):
        is_chat = request.url.path.endswith("/chat/completions")
        req = parse_model(ChatCompletionRequest if is_chat else CompletionRequest, request.content)
        self.requests.append(req)
        if req.model != MODEL:
            raise ModelNotFoundError(req.model)
        meta = ResponseMeta.for_chat(MODEL) if is_chat else ResponseMeta.for_completion(MODEL)
        usage = Usage.of(5, len(PIECES))
        if not req.stream:
            build = chat_completion_response if is_chat else completion_response
            return httpx2.Response(200, json=build(meta, "".join(PIECES), "length", usage)
                                   .model_dump(mode="json"))
        if is_chat:
            chunks = [chat_completion_chunk(meta, "", is_first=True)]
            chunks += [chat_completion_chunk(meta, p) for p in PIECES]
            chunks.append(chat_completion_chunk(meta, finish_reason="length"))
        else:
            chunks = [completion_chunk(meta, p) for p in PIECES[:-1]]
            chunks.append(completion_chunk(meta, PIECES[-1], "length"))
        if req.include_usage:
            chunks.append((chat_usage_chunk if is_chat else completion_usage_chunk)(meta, usage))
        body = "".join(sse_event(c) for c in chunks) + SSE_DONE
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=body.encode())


@pytest.fixture
def server_and_client():
    server = FakeServer()
    client = openai.OpenAI(api_key="test", base_url="http://helix.test/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(server)))
    return server, client


def test_openai_client_completions(server_and_client):
    server, client = server_and_client
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                    seed=1, stop=["\n"],
                                    extra_body={"top_k": 5, "ignore_eos": True})
    assert out.choices[0].text == "".join(PIECES) and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(PIECES)
    req = server.requests[-1]
    assert (req.max_tokens, req.top_k, req.ignore_eos, req.stop) == (4, 5, True, ["\n"])


def test_openai_client_completions_stream(server_and_client):
    _, client = server_and_client
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(PIECES)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 5 + len(PIECES)


def test_openai_client_chat(server_and_client):
    server, client = server_and_client
    out = client.chat.completions.create(
        model=MODEL, max_completion_tokens=4,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content == "".join(PIECES) and out.usage.prompt_tokens == 5
    assert server.requests[-1].max_new_tokens == 4


def test_openai_client_chat_stream(server_and_client):
    _, client = server_and_client
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(PIECES) and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(PIECES)


def test_openai_client_sees_our_400_with_param(server_and_client):
    _, client = server_and_client
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=3)
    assert (info.value.status_code, info.value.param, info.value.code) == (
        400, "temperature", "invalid_value")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       n=2)
    assert (info.value.param, info.value.code) == ("n", "unsupported_parameter")


def test_openai_client_sees_model_not_found(server_and_client):
    _, client = server_and_client
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert (info.value.code, info.value.param, info.value.type) == (
        "model_not_found", "model", "invalid_request_error")
