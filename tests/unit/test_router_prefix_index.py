"""The router's cache-aware policy (torch-free parts): a prompt's block keys are the ctx worker's
(same tokens, chat template included, same chain and salt, only the blocks a hit can use), each
worker's key set is bounded and LRU, events and resyncs update it, another epoch drops it, and
the choice weighs matched blocks against load (ties and no match: least loaded); polling a
loopback worker follows its events, resyncs a restarted one at once, and drops the blocks of a
worker that is gone or publishes nothing usable."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp", reason="server deps (fastapi, uvicorn, aiohttp, prometheus-client) not installed")

from helixserve.config import DeploymentConfig  # noqa: E402
from helixserve.kvcache.prefix_index import append_block_keys  # noqa: E402
from helixserve.models.tokenizer_loader import tokenizer_of  # noqa: E402
from helixserve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from helixserve.protocol.prefix_events import PrefixEventsAnswer  # noqa: E402
from helixserve.router.pool import WorkerPool, WorkerState  # noqa: E402
from helixserve.router.prefix_index import PrefixIndex, WorkerBlocks  # noqa: E402
from helixserve.router.prompt_keys import PromptKeys  # noqa: E402
from helixserve.router.upstream import Upstream  # noqa: E402
from helixserve.serving.openai_serving import ServingLimits, prompt_token_ids  # noqa: E402

B = 4
TOKENIZER = tokenizer_of("kimi-k3-tiny", "dummy")
LIMITS = ServingLimits("m", 4096, 512, None, 4096, 1 << 20)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.parametrize("body", [
    CompletionRequest(model="m", prompt="the system prompt, then a question"),
    CompletionRequest(model="m", prompt="the system prompt, then a question", cache_salt="tenant"),
    CompletionRequest(model="m", prompt=list(range(3 * B + 1))),
    ChatCompletionRequest(model="m", messages=[{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "why is the sky blue?"}]),
])
def test_prompt_keys_are_the_ctx_workers_keys_of_the_blocks_a_hit_can_use(body):
    ids = prompt_token_ids(body, TOKENIZER, LIMITS)  # as the ctx worker tokenizes it
    usable = (len(ids) - 1) // B * B
    keys = PromptKeys(TOKENIZER, B).block_keys(body)
    assert keys == append_block_keys([], ids[:usable], B, body.cache_salt) and len(keys) == usable // B


@pytest.mark.parametrize(("num_tokens", "num_keys"), [(1, 0), (B, 0), (B + 1, 1), (2 * B, 1), (2 * B + 1, 2)])
def test_the_last_token_is_never_in_a_key(num_tokens, num_keys):
    body = CompletionRequest(model="m", prompt=list(range(num_tokens)))
    assert len(PromptKeys(TOKENIZER, B).block_keys(body)) == num_keys


def test_hostile_prompts_have_no_keys_and_raise_nothing():
    keys = PromptKeys(TOKENIZER, B)
    assert keys.block_keys(CompletionRequest(model="m", prompt=[1 << 64] * 9)) == []
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x" * 9}])
    broken = PromptKeys(tokenizer_of("kimi-k3-tiny", "dummy"), B)
    broken.tokenizer.chat_template = "{{ raise_exception('no') }}"
    assert broken.block_keys(chat) == []


def test_without_a_tokenizer_only_token_id_prompts_have_keys():
    keys = PromptKeys(None, B)
    assert keys.block_keys(CompletionRequest(model="m", prompt="some text here")) == []
    assert len(keys.block_keys(CompletionRequest(model="m", prompt=list(range(9))))) == 2


def test_a_workers_set_is_bounded_least_recently_used_out_first_and_matches_from_the_first_key():
    blocks = WorkerBlocks(max_blocks=3)
    for i in range(3):
        blocks.add(_key(i))
    assert blocks.num_matched([_key(0), _key(1), _key(9), _key(2)]) == 2  # stops at the first miss
    blocks.add(_key(3))  # evicts key 2, the least recently matched
    assert len(blocks) == 3 and list(blocks.keys) == [_key(0), _key(1), _key(3)]
    assert blocks.num_matched([_key(9), _key(0)]) == 0


def _answer(epoch: str, seq: int, events=(), resync=False, blocks=()) -> PrefixEventsAnswer:
    return PrefixEventsAnswer(epoch=epoch, seq=seq, tokens_per_block=B, resync=resync,
                              events=[(s, k, _key(i).hex()) for s, k, i in events],
                              blocks=[_key(i).hex() for i in blocks])


def test_events_and_resyncs_update_a_set_and_another_epochs_events_drop_it():
    blocks = WorkerBlocks(max_blocks=8)
    assert blocks.apply(_answer("a", 5, resync=True, blocks=[1, 2]))
    assert blocks.apply(_answer("a", 7, events=[(6, "stored", 3), (7, "removed", 1)]))
    assert set(blocks.keys) == {_key(2), _key(3)} and blocks.seq == 7
    assert not blocks.apply(_answer("b", 1, events=[(1, "stored", 4)]))  # restarted: ask for a resync
    assert len(blocks) == 0 and blocks.seq is None and blocks.epoch is None
    assert blocks.apply(_answer("b", 1, resync=True, blocks=[4]))
    assert list(blocks.keys) == [_key(4)] and blocks.epoch == "b"


def _pool(load_weight: float = 1.0) -> tuple[WorkerPool, PrefixIndex]:
    urls = ["http://a", "http://b"]
    index = PrefixIndex(urls, max_blocks=64, tokens_per_block=B, load_weight=load_weight)
    pool = WorkerPool("ctx", urls, "cache_aware", index)
    for w in pool.workers:
        w.is_healthy, w.last_error = True, None
    return pool, index


def test_the_worker_holding_the_prefix_wins_until_its_load_outweighs_the_match():
    pool, index = _pool(load_weight=1.0)
    a, b = pool.workers
    prefix = [_key(i) for i in range(4)]
    index.routed(b.url, prefix[:3])
    assert index.choose(pool.workers, prefix) is b
    b.num_inflight = 3  # 3 blocks - 3 = 0 = a's 0 - 0: a tie, the least loaded
    assert index.choose(pool.workers, prefix) is a
    b.num_inflight = 2
    assert index.choose(pool.workers, prefix) is b
    index.load_weight = 0.5
    b.num_inflight = 5  # 3 - 2.5 > 0
    assert pool.pick(prefix) is b and index.num_blocks(b.url) == 4 and index.num_blocks(a.url) == 0


def test_no_match_goes_to_the_least_loaded_and_the_choice_is_remembered():
    pool, index = _pool()
    a, b = pool.workers
    a.num_inflight = 1
    fresh = [_key(100), _key(101)]
    assert pool.pick(fresh) is b and index.num_blocks(b.url) == 2  # b is about to cache them
    a.num_inflight, b.num_inflight = 0, 1
    assert pool.pick(fresh) is b  # 2 - 1 > 0 - 0
    assert pool.pick() is a  # no keys (no tokenizer, a tiny prompt): least loaded


def test_cache_aware_needs_prefix_caching():
    with pytest.raises(ValueError, match="set cache.prefix_caching: true"):
        DeploymentConfig.model_validate({"model": {"path": "kimi-k3-tiny"}, "router": {"policy": "cache_aware"}})


def test_a_match_below_the_cache_threshold_counts_as_none():
    pool, index = _pool()
    index.cache_threshold = 0.5
    a, b = pool.workers
    prompt = [_key(i) for i in range(10)]
    index.routed(b.url, prompt[:4])  # e.g. a chat template's opening: 4 of 10 blocks
    assert index.choose(pool.workers, prompt) is None
    index.routed(b.url, prompt[:5])
    assert index.choose(pool.workers, prompt) is b


def _poll(answers: list[tuple[int, dict]], tokens_per_block: int = B, rounds: int = 1,
          index: PrefixIndex | None = None) -> tuple[PrefixIndex, list[str]]:
    """Poll a loopback worker that answers ``answers`` in turn (a fault injector: another epoch,
    other blocks, errors) ``rounds`` times; the index and the paths the worker was asked."""
    paths: list[str] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        paths.append(head.split(b" ")[1].decode())
        status, body = answers[len(paths) - 1]
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)
        await writer.drain()
        writer.close()

    async def main() -> PrefixIndex:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        got = index or PrefixIndex([url], 64, tokens_per_block, 1.0)
        worker = WorkerState(url, "ctx", is_healthy=True)
        async with server, Upstream(1.0, 5.0, 4, {}) as client:
            for _ in range(rounds):
                await got.poll(client, [worker], timeout_s=2.0)
        return got

    return asyncio.run(main()), paths


def _body(answer: PrefixEventsAnswer) -> dict:
    return answer.model_dump(mode="json")


def test_polling_follows_the_events_and_resyncs_a_restarted_worker_at_once():
    answers = [(200, _body(_answer("old", 3, resync=True, blocks=[1, 2]))),
               (200, _body(_answer("old", 4, events=[(4, "stored", 3)]))),
               (200, _body(_answer("new", 9, events=[(9, "stored", 8)]))),  # restarted: not a resync
               (200, _body(_answer("new", 9, resync=True, blocks=[7])))]
    index, paths = _poll(answers, rounds=3)
    assert paths == ["/v1/prefix_events?max_blocks=64", "/v1/prefix_events?max_blocks=64&since=3",
                     "/v1/prefix_events?max_blocks=64&since=4", "/v1/prefix_events?max_blocks=64"]
    (blocks,) = index.workers.values()
    assert list(blocks.keys) == [_key(7)] and blocks.epoch == "new" and blocks.seq == 9


@pytest.mark.parametrize("answer", [
    (404, {"detail": "Not Found"}),  # prefix caching off, or a ctx world
    (200, {"epoch": "e", "seq": 1}),  # malformed
    (200, _body(_answer("e", 1, resync=True, blocks=[1])) | {"tokens_per_block": B * 2}),  # other blocks
])
def test_a_worker_that_publishes_nothing_usable_has_its_blocks_dropped(answer):
    index, paths = _poll([(200, _body(_answer("e", 1, resync=True, blocks=[1, 2]))), answer], rounds=2)
    (blocks,) = index.workers.values()
    assert len(paths) == 2 and len(blocks) == 0 and blocks.seq is None


def test_an_unreachable_or_unhealthy_worker_has_its_blocks_dropped():
    index = PrefixIndex(["http://127.0.0.1:9"], 64, B, 1.0)
    index.routed("http://127.0.0.1:9", [_key(1)])
    worker = WorkerState("http://127.0.0.1:9", "ctx", is_healthy=True)

    async def main() -> None:
        async with Upstream(1.0, 5.0, 4, {}) as client:
            await index.poll(client, [worker], timeout_s=2.0)

    asyncio.run(main())
    assert index.num_blocks(worker.url) == 0
    index.routed(worker.url, [_key(1)])
    worker.is_healthy = False
    asyncio.run(main())
    assert index.num_blocks(worker.url) == 0
