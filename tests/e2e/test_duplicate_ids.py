"""Duplicate request ids on the workers' internal ports.

A request refused because its ``X-Request-Id`` is already in use must never touch the cache of
the request that holds the id: on the ctx port (a ``context_only`` or plain request naming a
held prefill, which the KV sender still serves) and on the gen port (a ``generation_only`` naming
a request that is decoding). The held request's pickup must still decode the right answer."""

from __future__ import annotations

import threading

from tests.e2e.conftest import MODEL, Deployment, http, wait_until

SHARED_DEPLOYMENT = "disagg"  # conftest: one deployment for these modules

PROMPT = list(range(100, 117))  # 17 tokens: 5 blocks of 4, the last one partial
OTHER_PROMPTS = [list(range(300 + 40 * i, 333 + 40 * i)) for i in range(4)]  # 33 tokens each
BODY = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CONTEXT_ONLY = {"request_type": "context_only"}


def _post(url: str, body: dict, request_id: str | None = None) -> tuple[int, dict]:
    headers = {"X-Request-Id": request_id} if request_id is not None else {}
    return http("POST", f"{url}/v1/completions", body, headers=headers)


def _prefill(dep: Deployment, prompt: list[int], request_id: str, **extra) -> dict:
    status, answer = _post(dep.ctx_url, {**BODY, "prompt": prompt, **extra,
                                         "disaggregated_params": CONTEXT_ONLY}, request_id)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] is None  # held for a gen worker
    return answer


def _pickup_body(ctx_answer: dict, prompt: list[int], **extra) -> dict:
    params = {**ctx_answer["disaggregated_params"], "request_type": "generation_only"}
    return {**BODY, "prompt": prompt, **extra, "disaggregated_params": params}


def _assert_duplicate(status: int, answer: dict) -> None:
    """400 with OpenAI's error body: the duplicate_request_id code and a message naming the id."""
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "duplicate_request_id" and error["type"] == "invalid_request_error", answer
    assert "request id" in error["message"], answer


def test_duplicate_id_on_ctx_does_not_touch_the_held_prefill(dep):
    """A held prefill keeps its cache through a context_only and a plain request with its id;
    requests that run afterwards cannot take its blocks, and its pickup decodes the right text."""
    expected = _post(dep.gen_url, {**BODY, "prompt": PROMPT})[1]["choices"][0]["text"]
    first = _prefill(dep, PROMPT, "dup-held")
    held = dep.stats("ctx")
    assert held["pickups_held"] == 1 and held["num_used_blocks"] > 0

    _assert_duplicate(*_post(dep.ctx_url, {**BODY, "prompt": OTHER_PROMPTS[0],
                                           "disaggregated_params": CONTEXT_ONLY}, "dup-held"))
    status, answer = _post(dep.ctx_url, {**BODY, "prompt": OTHER_PROMPTS[1]}, "dup-held")  # plain
    assert status == 400, answer
    after = dep.stats("ctx")
    assert (after["pickups_held"], after["num_held"], after["num_used_blocks"], after["num_used_slots"]) == \
        (1, 1, held["num_used_blocks"], held["num_used_slots"])

    for prompt in OTHER_PROMPTS:  # would take the held request's blocks and state slot if freed
        status, answer = _post(dep.ctx_url, {**BODY, "prompt": prompt})
        assert status == 200, answer
    status, answer = _post(dep.gen_url, _pickup_body(first, PROMPT))
    assert status == 200, answer
    assert answer["choices"][0]["text"] == expected
    wait_until(dep.is_idle, 10, "nothing held on ctx or gen", state=lambda: dep.stats("ctx"))


def test_duplicate_id_on_gen_does_not_touch_the_decoding_request(dep):
    """A generation_only naming a request that is decoding on gen is refused and frees nothing
    of it (nor of its own ctx hold, which the router then releases); the first answer is right."""
    long_body = {**BODY, "max_tokens": 48}
    expected = _post(dep.gen_url, {**long_body, "prompt": PROMPT})[1]["choices"][0]["text"]
    first = _prefill(dep, PROMPT, "dup-gen-a", max_tokens=48)
    second = _prefill(dep, OTHER_PROMPTS[2], "dup-gen-b")
    got: dict = {}
    runner = threading.Thread(target=lambda: got.update(
        zip(("status", "answer"), _post(dep.gen_url, _pickup_body(first, PROMPT, max_tokens=48), "g-dup"))))
    runner.start()
    try:
        wait_until(lambda: dep.stats("gen")["num_running"] == 1, 20, "gen decoding the first request")
        _assert_duplicate(*_post(dep.gen_url, _pickup_body(second, OTHER_PROMPTS[2]), "g-dup"))
    finally:
        runner.join(60)
    assert got["status"] == 200, got
    assert got["answer"]["choices"][0]["text"] == expected
    status, released = http("POST", f"{dep.ctx_url}/v1/release",
                            {"request_id": "dup-gen-b", "admission": second["disaggregated_params"]["ctx_admission"]})
    assert status == 200 and released["released"], released
    wait_until(dep.is_idle, 10, "nothing held on ctx or gen", state=lambda: dep.stats("ctx"))


def test_two_pickups_of_one_prefill_never_break_each_other(dep):
    """Two generation_only requests naming the same ctx request (sent at once): the ctx refuses
    shards already picked up, and a refusal must not cancel the other request's transfer. Each
    answer is the right text or a 503 / 504 naming the refusal (both fail when each won one CP
    rank), and nothing stays held. (A served-level guard: the tiny transfer usually ends before
    the refusal, so the old Cancel rarely hit it here; test_transceiver_local.py pins that race.)"""
    expected = _post(dep.gen_url, {**BODY, "prompt": PROMPT})[1]["choices"][0]["text"]
    first = _prefill(dep, PROMPT, "dup-pickup")
    results: dict[str, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda rid=rid: results.__setitem__(
        rid, _post(dep.gen_url, _pickup_body(first, PROMPT), rid))) for rid in ("pick-a", "pick-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2, results
    for status, answer in results.values():
        if status == 200:
            assert answer["choices"][0]["text"] == expected, results
        else:
            assert status in (503, 504) and "refused the transfer" in answer["error"]["message"], results
    wait_until(dep.is_idle, 10, "nothing held on ctx or gen", state=lambda: dep.stats("ctx"))
