"""Router -> ctx -> gen on loopback, through the ``openai`` client: answers, streams, equivalence
with aggregated serving, concurrency, bad inputs, disconnects, 429 and API keys.

The gen worker is a dp 1 x cp 2 helix world receiving each request's KV over UCX (each CP rank its
shard); the aggregated baselines are that world without ``disaggregated_params`` and a
single-process gen worker (dp = cp = 1)."""

from __future__ import annotations

import http.client as httplib
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai
import pytest

from tests.e2e.conftest import MODEL, Deployment, http, metric, wait_until

SHARED_DEPLOYMENT = "disagg"  # conftest: one deployment for these modules

# token-id prompts of 1..33 tokens: with tokens_per_block=4 they end inside and on block edges
ID_PROMPTS = [[65], [72, 105, 33], [1, 2, 3, 4], [10, 20, 30, 40, 50], list(range(40, 49)),
              list(range(100, 117)), list(range(200, 233))]
TEXT_PROMPTS = ["Hello, helix", "The quick brown fox jumps over the lazy dog", "é€😀 unicode"]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
IGNORE_EOS = {"ignore_eos": True}


def complete(client: openai.OpenAI, prompt, max_tokens: int = 8, stream: bool = False,
             sampling: dict = GREEDY, **extra):
    """``(text, finish_reason, usage)`` of one completion, streamed or not."""
    params = {k: v for k, v in sampling.items() if k != "seed"}
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=sampling.get("seed"),
                  extra_body={**IGNORE_EOS, **extra.pop("extra_body", {})}, **params, **extra)
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump()
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.model_dump()
    return text, finish, usage


def chat(client: openai.OpenAI, content: str, max_tokens: int = 8, stream: bool = False):
    kwargs = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": content}],
                  max_tokens=max_tokens, temperature=0.0, extra_body=IGNORE_EOS)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.model_dump()
    text, finish, usage, roles = "", None, None, []
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            text += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.model_dump()
    assert roles == ["assistant"]
    return text, finish, usage


def _samples(url: str) -> dict[str, float]:
    """``sample (name and labels) -> value`` of a ``/metrics`` page."""
    lines = http("GET", f"{url}/metrics")[1].splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


@pytest.fixture(scope="module", autouse=True)
def at_start(dep) -> dict[str, dict[str, float]]:
    """Every counter of router, ctx and gen as this module starts (the deployment is shared)."""
    return {role: _samples(url) for role, url in (("router", dep.router_url), ("ctx", dep.ctx_url),
                                                   ("gen", dep.gen_url))}


def test_models_health_and_ready(dep):
    assert [m.id for m in dep.client().models.list().data] == [MODEL]
    assert http("GET", f"{dep.router_url}/health")[0] == 200
    status, ready = http("GET", f"{dep.router_url}/ready")
    assert status == 200 and ready["ready"] and ready["ctx"][0]["healthy"]


def test_completions_and_chat_streamed_equal_non_streamed(dep):
    client = dep.client()
    for prompt in (TEXT_PROMPTS[0], ID_PROMPTS[4]):
        whole = complete(client, prompt, max_tokens=10)
        assert whole[1] == "length" and whole[2]["completion_tokens"] == 10
        assert complete(client, prompt, max_tokens=10, stream=True) == whole
    whole = chat(client, "Hi there", max_tokens=7)
    assert whole[1] == "length" and whole[2]["completion_tokens"] == 7
    assert chat(client, "Hi there", max_tokens=7, stream=True) == whole


def _transfers(dep: Deployment) -> tuple[float, float, float]:
    return (metric(dep.gen_url, "helixserve_worker_kv_transfers_completed_total"),
            metric(dep.gen_url, "helixserve_worker_kv_transfer_failures_total"),
            metric(dep.ctx_url, "helixserve_worker_kv_transfers_completed_total"))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_equals_aggregated(dep, sampling):
    """Router (ctx prefill -> UCX -> cp=2 gen world decode) answers == the gen world alone
    (prefill + decode) == a single-process gen worker; every one of them moved its KV over UCX."""
    disagg, world, single = dep.client(), dep.client(dep.gen_url), dep.client(dep.baseline_url)
    cases = [(p, n, s) for p, n in zip(ID_PROMPTS + TEXT_PROMPTS, [5, 9, 12, 3, 8, 11, 6, 10, 7, 9])
             for s in (False, True)]
    received, failed, acknowledged = _transfers(dep)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: complete(disagg, c[0], c[1], c[2], sampling), cases))
    for (prompt, n, stream), answer in zip(cases, got):
        assert answer == complete(world, prompt, n, stream, sampling), (prompt, n, stream)
        assert answer == complete(single, prompt, n, stream, sampling), (prompt, n, stream)
        assert answer[2]["completion_tokens"] == n
    assert _transfers(dep)[:2] == (received + len(cases), failed)
    # the ctx freed each hold when both CP ranks acknowledged their shard
    wait_until(lambda: _transfers(dep)[2] == acknowledged + len(cases), 5, "every ack on ctx")
    wait_until(dep.is_idle, 5, "nothing held on ctx or gen")


def test_stop_strings_max_tokens_and_first_token_finish(dep):
    disagg, agg = dep.client(), dep.client(dep.gen_url)
    prompt = TEXT_PROMPTS[1]
    free_text, _, _ = complete(agg, prompt, max_tokens=24)
    stop = next(free_text[i:i + 2] for i in range(4, len(free_text) - 1)
                if "\ufffd" not in free_text[i:i + 2])
    expected = free_text[:free_text.index(stop)]
    for client in (disagg, agg):
        for stream in (False, True):
            text, finish, _ = complete(client, prompt, max_tokens=24, stream=stream, stop=[stop])
            assert (text, finish) == (expected, "stop")
    # finished on ctx at the first token: max_tokens=1, and a stop token id that is the first token
    assert complete(disagg, prompt, 1) == complete(agg, prompt, 1)
    status, ctx_answer = http("POST", f"{dep.ctx_url}/v1/completions", {
        "model": MODEL, "prompt": ID_PROMPTS[5], "max_tokens": 1, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only"}})
    assert status == 200 and ctx_answer["choices"][0]["finish_reason"] == "length"
    first_token = ctx_answer["disaggregated_params"]["first_gen_tokens"][0]
    for stream in (False, True):
        one = complete(disagg, ID_PROMPTS[5], 5, stream, extra_body={"stop_token_ids": [first_token]})
        assert one == complete(agg, ID_PROMPTS[5], 5, stream,
                               extra_body={"stop_token_ids": [first_token]})
        assert one[1] == "stop" and one[2]["completion_tokens"] == 1


def test_32_concurrent_requests_all_correct(dep):
    client, agg = dep.client(), dep.client(dep.gen_url)
    prompts = [ID_PROMPTS[1], ID_PROMPTS[4], TEXT_PROMPTS[0], TEXT_PROMPTS[1]]
    expected = [complete(agg, p, 6) for p in prompts]

    def one(i: int):
        if i % 4 == 3:
            return chat(client, f"question {i % 2}", 6, stream=bool(i % 2))
        return complete(client, prompts[i % 4], 6, stream=bool(i % 2))

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, range(32)))
    chats = {s: chat(agg, f"question {s}", 6) for s in (0, 1)}
    for i, answer in enumerate(answers):
        want = chats[i % 2] if i % 4 == 3 else expected[i % 4]
        assert answer == want, i
        assert answer[2]["total_tokens"] == answer[2]["prompt_tokens"] + 6


BAD_INPUTS = [
    ("completions", b"{not json", 400, None, "invalid_json"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "hi", "bogus": 1}, 400, "bogus", "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [99999]}, 400,
     "stop_token_ids", None),
    ("completions", {"model": MODEL, "prompt": "hi",
                     "disaggregated_params": {"request_type": "context_only"}}, 400,
     "disaggregated_params", None),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", "unsupported_parameter"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400,
     "messages[0].content", "missing_required_parameter"),
]


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD_INPUTS)
def test_bad_input_gets_openai_4xx(dep, endpoint, body, status, param, code):
    got_status, got = http("POST", f"{dep.router_url}/v1/{endpoint}", body)
    assert got_status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_openai_client_raises_typed_errors_and_servers_stay_healthy(dep):
    client = dep.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="y" * 400, max_tokens=2)
    for url in (dep.router_url, dep.ctx_url, dep.gen_url):
        assert http("GET", f"{url}/health")[0] == 200
    assert complete(client, "still fine", 3)[1] == "length"
    status, _ = http("GET", f"{dep.router_url}/v1/nowhere")
    assert status == 404


def _idle(dep: Deployment) -> bool:
    """From /metrics: no block or slot in use, nothing held or in flight, on ctx and gen."""
    gen_blocks = metric(dep.gen_url, "helixserve_worker_cache_blocks_used")
    gen_slots = metric(dep.gen_url, "helixserve_worker_state_slots_used")
    ctx_blocks = metric(dep.ctx_url, "helixserve_worker_cache_blocks_used")
    live = metric(dep.gen_url, "helixserve_worker_requests_live")
    held = metric(dep.ctx_url, "helixserve_worker_requests_held")
    pickups = metric(dep.ctx_url, "helixserve_worker_pickups_held")
    return gen_blocks == gen_slots == ctx_blocks == live == held == pickups == 0


def _open_stream(url: str, body: dict) -> httplib.HTTPConnection:
    parsed = urlparse(url)
    conn = httplib.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_client_disconnect_mid_stream_frees_cache_on_ctx_and_gen(dep):
    cancelled = 'helixserve_router_requests_total{endpoint="/v1/completions",status="499"}'
    cancelled_before = metric(dep.router_url, cancelled, default=0.0)
    body = {"model": MODEL, "prompt": list(range(30)), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    generated_before = metric(dep.gen_url, "helixserve_worker_generation_tokens_total", 0.0)
    conn = _open_stream(dep.router_url, body)
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # first chunk arrived: gen is decoding
    wait_until(lambda: dep.stats("gen")["num_running"] == 1, 10, "gen running the request")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: _idle(dep), 10, "zero blocks in use on ctx and gen")
    assert metric(dep.router_url, cancelled) == cancelled_before + 1
    # aborted, not run to its 200 tokens (a finished request adds its tokens to the counter)
    assert metric(dep.gen_url, "helixserve_worker_generation_tokens_total", 0.0) == generated_before


def test_client_disconnect_before_the_answer_frees_cache(dep):
    body = {"model": MODEL, "prompt": list(range(30)), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    generated_before = metric(dep.gen_url, "helixserve_worker_generation_tokens_total", 0.0)
    conn = _open_stream(dep.router_url, body)
    wait_until(lambda: dep.stats("gen")["num_running"] == 1, 10, "gen running the request")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: _idle(dep), 10, "zero blocks in use on ctx and gen")
    assert metric(dep.gen_url, "helixserve_worker_generation_tokens_total", 0.0) == generated_before


def test_full_router_queue_answers_429(dep, tmp_path):
    url, proc = dep.extra_router(tmp_path, max_inflight=1, max_queue_len=0)
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn = _open_stream(url, body)
        assert conn.getresponse().status == 200
        with pytest.raises(openai.RateLimitError, match="capacity"):
            dep.client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        conn.close()
        wait_until(lambda: _idle(dep), 10, "the long request to be cancelled")
        assert complete(dep.client(url), "hi", 2)[1] == "length"  # the slot came back
    finally:
        proc.terminate()
        proc.wait(10)


def test_api_key_required_when_configured(dep, tmp_path):
    url, proc = dep.extra_router(tmp_path, api_keys=("sekrit",))
    try:
        with pytest.raises(openai.AuthenticationError):
            dep.client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            dep.client(url, api_key="wrong").models.list()
        assert complete(dep.client(url, api_key="sekrit"), "hi", 2)[1] == "length"
        assert http("GET", f"{url}/health")[0] == 200  # liveness needs no key
    finally:
        proc.terminate()
        proc.wait(10)


def test_api_keys_from_the_environment(dep, tmp_path):
    """``HELIXSERVE_API_KEYS`` (compose's env file) adds keys without the YAML holding them."""
    url, proc = dep.extra_router(tmp_path, env={"HELIXSERVE_API_KEYS": " env-key-1 ,, env-key-2 "},
                                 api_keys=("yaml-key",))
    try:
        with pytest.raises(openai.AuthenticationError):
            dep.client(url).models.list()
        for key in ("env-key-1", "env-key-2", "yaml-key"):
            assert [m.id for m in dep.client(url, api_key=key).models.list().data] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            dep.client(url, api_key="env-key-1 ,, env-key-2").models.list()
    finally:
        proc.terminate()
        proc.wait(10)


def test_metrics_count_requests_tokens_and_latencies(dep, at_start):
    now = {role: _samples(url) for role, url in (("router", dep.router_url), ("ctx", dep.ctx_url),
                                                  ("gen", dep.gen_url))}

    def moved(role: str, name: str) -> float:
        """How far the sample ``name`` (with its labels, or the first labeled one) of ``role``
        moved while this module ran."""
        sample = next(s for s in now[role] if s == name or ("{" not in name and s.startswith(name + "{")))
        return now[role][sample] - at_start[role].get(sample, 0.0)

    for name in ("helixserve_router_time_to_first_token_seconds_count",
                 "helixserve_router_inter_token_latency_seconds_count",
                 "helixserve_router_e2e_request_latency_seconds_count",
                 "helixserve_router_queue_time_seconds_count",
                 "helixserve_router_prompt_tokens_total", "helixserve_router_generation_tokens_total"):
        assert moved("router", name) > 0, name
    assert moved("router", 'helixserve_router_requests_total{endpoint="/v1/completions",status="200"}') > 0
    for status in ("400", "404"):
        assert any(moved("router", sample) > 0 for sample in now["router"]
                   if sample.startswith("helixserve_router_requests_total{") and f'status="{status}"' in sample)
    assert any(sample.startswith("helixserve_router_worker_healthy") for sample in now["router"])
    assert now["router"]["helixserve_router_requests_running"] == 0
    assert moved("ctx", "helixserve_worker_pickups_released_total") > 0
    assert moved("ctx", "helixserve_worker_pickups_expired_total") == 0
    for role, url in (("ctx", dep.ctx_url), ("gen", dep.gen_url)):  # KV transfers, per worker
        labels = f'{{role="{role}",url="{url}"}}'
        assert moved("router", f"helixserve_router_worker_kv_transfer_bytes{labels}") > 0
        assert moved("router", f"helixserve_router_worker_kv_transfer_seconds{labels}") > 0
        assert moved("router", f"helixserve_router_worker_kv_transfer_failures{labels}") == 0
    assert moved("gen", "helixserve_worker_kv_transfer_bytes_total") == \
        moved("ctx", "helixserve_worker_kv_transfer_bytes_total")  # every shard, counted once
