"""DisaggregatedParams, KVLayout and TransceiverEndpoint validation and the router's hand-off."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from helixserve.protocol import (CompletionRequest, DisaggregatedParams, InvalidRequestError,
                                 KVLayout, RequestType, ResponseMeta, TransceiverEndpoint, Usage,
                                 completion_response, parse_model, validation_error_to_openai)

LAYER_KINDS = ["kda", "kda", "kda", "mla"] * 2


def layout_dict(**over):
    return {"model": "kimi-k3-tiny", "tokens_per_block": 16, "layer_kinds": LAYER_KINDS,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_kda_heads": 4, "kda_head_dim": 32,
            "conv_kernel_size": 4, "kv_dtype": "bfloat16", "state_dtype": "float32",
            "conv_dtype": "bfloat16", "ctx_tp_size": 1, **over}


def ctx_answer(**over):
    return {"request_type": "context_only", "ctx_request_id": "cmpl-abc",
            "first_gen_tokens": [17], "prompt_token_ids": [1, 2, 3],
            "ctx_endpoint": {"host": "10.0.0.2", "port": 50051}, "layout": layout_dict(), **over}


def test_context_only_request_needs_only_the_type():
    params = DisaggregatedParams.model_validate({"request_type": "context_only"})
    assert params.is_context_only and params.request_type is RequestType.CONTEXT_ONLY
    assert params.first_gen_tokens == [] and params.layout is None


def test_ctx_answer_round_trip_and_hand_off():
    params = DisaggregatedParams.model_validate(ctx_answer())
    assert DisaggregatedParams.model_validate_json(params.model_dump_json()) == params
    gen = params.for_generation()
    assert gen.is_generation_only and not params.is_generation_only
    assert gen.model_dump(exclude={"request_type"}) == params.model_dump(exclude={"request_type"})
    assert json.loads(gen.model_dump_json())["request_type"] == "generation_only"


@pytest.mark.parametrize("field", ["ctx_request_id", "first_gen_tokens", "prompt_token_ids",
                                   "ctx_endpoint", "layout"])
def test_generation_only_requires_everything(field):
    body = ctx_answer(request_type="generation_only")
    body.pop(field)
    with pytest.raises(ValidationError) as info:
        DisaggregatedParams.model_validate(body)
    err = validation_error_to_openai(info.value)
    assert (err.status_code, err.param) == (400, field)
    with pytest.raises(ValidationError):
        DisaggregatedParams.model_validate({**ctx_answer(), field: None}).for_generation()


def test_generation_only_rejects_empty_first_tokens():
    with pytest.raises(ValidationError):
        DisaggregatedParams.model_validate(ctx_answer(request_type="generation_only",
                                                      first_gen_tokens=[]))


@pytest.mark.parametrize("over, param", [
    ({"request_type": "prefill"}, "request_type"),
    ({"request_type": None}, "request_type"),
    ({"ctx_request_id": ""}, "ctx_request_id"),
    ({"first_gen_tokens": [-1]}, "first_gen_tokens[0]"),
    ({"first_gen_tokens": ["a"]}, "first_gen_tokens[0]"),
    ({"prompt_token_ids": [0, 5, -7]}, "prompt_token_ids[2]"),
    ({"ctx_endpoint": {"host": "", "port": 1}}, "ctx_endpoint.host"),
    ({"ctx_endpoint": {"host": "h", "port": 0}}, "ctx_endpoint.port"),
    ({"ctx_endpoint": {"host": "h", "port": 70000}}, "ctx_endpoint.port"),
    ({"ctx_endpoint": {"host": "h", "port": "80"}}, "ctx_endpoint.port"),
    ({"extra": 1}, "extra"),
])
def test_bad_params_name_the_field(over, param):
    with pytest.raises(ValidationError) as info:
        DisaggregatedParams.model_validate(ctx_answer(**over))
    assert validation_error_to_openai(info.value).param == param


@pytest.mark.parametrize("field, value", [
    ("tokens_per_block", 0), ("tokens_per_block", -16), ("kv_lora_rank", 0),
    ("qk_rope_head_dim", -1), ("num_kda_heads", 0), ("kda_head_dim", -128),
    ("conv_kernel_size", 0), ("ctx_tp_size", 0), ("tokens_per_block", 16.0),
    ("kv_dtype", "int8"), ("conv_dtype", "torch.bfloat16"), ("state_dtype", None),
    ("layer_kinds", []), ("layer_kinds", ["kda", "gqa"]), ("model", ""), ("bogus", 1),
])
def test_bad_layout_fields(field, value):
    with pytest.raises(ValidationError) as info:
        KVLayout.model_validate(layout_dict(**{field: value}))
    assert validation_error_to_openai(info.value).param.startswith(field)


def test_layout_kda_heads_must_split_over_ctx_tp():
    KVLayout.model_validate(layout_dict(ctx_tp_size=2))
    with pytest.raises(ValidationError) as info:
        KVLayout.model_validate(layout_dict(ctx_tp_size=3))
    assert validation_error_to_openai(info.value).param == "ctx_tp_size"


def test_layout_ctx_rank_is_a_rank_of_its_world():
    assert KVLayout.model_validate(layout_dict(ctx_tp_size=2, ctx_rank=1)).ctx_rank == 1
    for rank in (2, -1):
        with pytest.raises(ValidationError) as info:
            KVLayout.model_validate(layout_dict(ctx_tp_size=2, ctx_rank=rank))
        assert validation_error_to_openai(info.value).param == "ctx_rank"
    one = KVLayout.model_validate(layout_dict(ctx_tp_size=2))
    assert one.mismatches(KVLayout.model_validate(layout_dict(ctx_tp_size=2, ctx_rank=1))) == []
    assert one.mismatches(KVLayout.model_validate(layout_dict(ctx_tp_size=2, ctx_rank=1)),
                          ignore=frozenset()) == ["ctx_rank: 0 != 1"]


def test_layout_helpers():
    layout = KVLayout.model_validate(layout_dict())
    assert layout.mla_layers == [3, 7] and layout.kda_layers == [0, 1, 2, 4, 5, 6]
    assert [layout.num_blocks(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        layout.num_blocks(-1)
    assert layout.mismatches(KVLayout.model_validate(layout_dict(ctx_tp_size=2))) == []
    other = KVLayout.model_validate(layout_dict(tokens_per_block=32, kv_dtype="float16"))
    diffs = layout.mismatches(other)
    assert len(diffs) == 2 and diffs[0].startswith("tokens_per_block: 16 != 32")
    assert "kv_dtype" in diffs[1]


def test_endpoint():
    assert TransceiverEndpoint(host="::1", port=65535).port == 65535


def test_params_inside_requests_and_responses():
    req = parse_model(CompletionRequest, {"model": "m", "prompt": "hi",
                                          "disaggregated_params": ctx_answer(
                                              request_type="generation_only")})
    assert req.disaggregated_params.is_generation_only
    assert parse_model(CompletionRequest, req.model_dump_json()) == req
    with pytest.raises(InvalidRequestError) as info:
        parse_model(CompletionRequest, {"model": "m", "prompt": "hi", "stream": True,
                                        "disaggregated_params": {"request_type": "context_only"}})
    assert info.value.param == "stream"
    with pytest.raises(InvalidRequestError) as info:
        parse_model(CompletionRequest, {"model": "m", "prompt": "hi", "disaggregated_params": {
            "request_type": "generation_only", "ctx_request_id": "x"}})
    assert info.value.param == "disaggregated_params.first_gen_tokens"
    params = DisaggregatedParams.model_validate(ctx_answer())
    resp = completion_response(ResponseMeta.for_completion("m"), "A", "stop", Usage.of(3, 1),
                               disaggregated_params=params)
    body = json.loads(resp.model_dump_json())
    assert DisaggregatedParams.model_validate(body["disaggregated_params"]) == params
    plain = completion_response(ResponseMeta.for_completion("m"), "A", "stop", Usage.of(3, 1))
    assert "disaggregated_params" not in json.loads(plain.model_dump_json())


def _world_answer(tp: int, endpoints: list[dict], **over) -> dict:
    return ctx_answer(request_type="generation_only", layout=layout_dict(ctx_tp_size=tp),
                      ctx_endpoints=endpoints, **over)


def _rank(r: int) -> dict:
    return {"host": "10.0.0.2", "port": 50051 + r}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ctx_worlds_answer_names_each_rank_and_its_ticket_carries_them(tp):
    from helixserve.transceiver.ticket import KVTicket

    params = DisaggregatedParams.model_validate(_world_answer(tp, [_rank(r) for r in range(tp)]))
    ticket = KVTicket.from_params(params)
    assert [e.port for e in ticket.ctx_endpoints] == [50051 + r for r in range(tp)]
    for cp_rank, cp_size in ((0, 2), (1, 2), (3, 4)):  # each source ticket names its own rank's sender
        for source in ticket.source_tickets(cp_rank, cp_size):
            assert source.ctx_endpoint.port == 50051 + source.layout.ctx_rank and not source.ctx_endpoints
    one = DisaggregatedParams.model_validate(ctx_answer(request_type="generation_only"))
    assert one.ctx_endpoints == [] and KVTicket.from_params(one).ctx_endpoints == ()


@pytest.mark.parametrize("tp, ranks, message", [
    (2, [], "names 0 ctx ranks, the layout's ctx world has ctx_tp_size=2"),
    (2, [0], "names 1 ctx ranks, the layout's ctx world has ctx_tp_size=2"),
    (2, [0, 1, 2], "names 3 ctx ranks"),
    (1, [0, 1], "names 2 ctx ranks, the layout's ctx world has ctx_tp_size=1"),
    (2, [1, 0], r"ctx_endpoints\[0\] \(10.0.0.2:50052\) is not ctx_endpoint"),
])
def test_ctx_endpoints_that_do_not_fit_the_layout_are_refused_naming_them(tp, ranks, message):
    with pytest.raises(ValidationError, match=message) as info:
        DisaggregatedParams.model_validate(_world_answer(tp, [_rank(r) for r in ranks]))
    assert validation_error_to_openai(info.value).param == "ctx_endpoints"


def test_too_many_ctx_endpoints_are_refused_before_they_are_read():
    with pytest.raises(ValidationError) as info:
        DisaggregatedParams.model_validate(_world_answer(2, [_rank(0)] * 1025))
    assert validation_error_to_openai(info.value).param == "ctx_endpoints"
