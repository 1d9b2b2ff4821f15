"""The SPMD generation world (gloo): WorldDriver on rank 0, CP leaders' EngineCore, followers.

- requests arriving over time, spread over both CP groups of a 2 x 2 world, give the
  single-process engine's tokens (greedy and seeded sampling), an abort frees everything, a
  held cache waits for release, idle worlds send heartbeat plans without running the model, and
  every rank runs the same number of forwards (real or empty: the MoE all-to-alls pair up);
- a request whose prompt KV "arrives" (a fake receiver writes each rank's shard: blocks
  b % cp == cp_rank, its KDA heads) decodes exactly like the single-process engine; a transfer
  failing on one rank fails the request on the whole group, agreed through the transceiver's
  consensus (``transceiver.consensus.TransferConsensus``, the code the bounded_polling tests
  exercise): the failing rank's cause reaches its CP leader only through that all-gather;
- a rank that raises stops the world with an error, within the collective timeout;
- ``helixserve generate --dp 2 --cp 2 --json`` prints what the single-process run prints.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.config import CacheConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.spmd.follower import Follower
from helixserve.engine.spmd.messages import WorldStoppedError
from helixserve.engine.spmd.driver import drive_to_completion
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.launch.processes import LocalWorldError, run_local_world
from helixserve.models.caches import SeqChunk, build_batch
from helixserve.models.loading import load_model
from helixserve.models.presets import get_preset
from helixserve.parallel import Mapping, init_parallel
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.transceiver.layout import layout_for
from helixserve.transceiver.ticket import KVTicket

CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=6)
OPTIONS = WorldOptions(cache=CACHE, timeout_s=30)
PRESET = "kimi-k3-tiny"


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


REQUESTS = [  # (prompt, params, arrives before step)
    (_prompt(1, 9), SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), 0),
    (_prompt(2, 17), SamplingParams(max_tokens=5, temperature=0.8, seed=11, ignore_eos=True), 0),
    (_prompt(3, 3), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), 2),
    (_prompt(4, 6), SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=5, ignore_eos=True), 3),
    (_prompt(5, 11), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), 3),
]
ABORTED = "late-abort"
KV_ABORTED = "kv-aborted"
HELD = "held"
KV_PROMPTS = [_prompt(6, 10), _prompt(7, 5), _prompt(8, 7)]  # the second fails on rank 3
KV_PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 2 + [
    SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)]
FAILING_RANK = 3


def _ticket(j: int, first_token: int, failing: bool = False) -> KVTicket:
    """KV_PROMPTS[j]'s ticket (the fake receiver reads the prompt and the failing rank off its id;
    the endpoint is never dialled)."""
    return KVTicket(f"kv{j}" + ("-failing" if failing else ""), TransceiverEndpoint(host="127.0.0.1", port=1),
                    layout_for(get_preset(PRESET), torch.float32, CACHE.tokens_per_block, PRESET),
                    len(KV_PROMPTS[j]), (first_token,))


class _FakeReceiver:
    """Writes this rank's shard of a single-process prefill, reporting after two polls."""

    def __init__(self, model_dir, mapping: Mapping) -> None:
        self.ref = load_model(model_dir)
        self.mapping = mapping
        self.pending: dict[str, list] = {}
        self.cancelled: list[str] = []
        self.waits: list[bool] = []  # each poll's `wait`

    def start(self, request_id, handle, caches, ticket) -> None:
        prompt = KV_PROMPTS[int(ticket.ctx_request_id.removeprefix("kv").removesuffix("-failing"))]
        fail_on_rank = FAILING_RANK if ticket.ctx_request_id.endswith("-failing") else None
        cfg, tpb = self.ref.cfg, caches.tokens_per_block
        full = allocate_model_caches(cache_spec_for(cfg, torch.float32, tpb), 16, 1)
        self.ref(build_batch([SeqChunk(prompt, 0, 0)], tpb, 16), full)
        cp, r = self.mapping.cp, self.mapping.cp_rank
        for layer, pool in caches.mla_kv.items():
            for k, physical in enumerate(handle.block_ids):
                pool[physical] = full.mla_kv[layer][r + k * cp]
        heads = self.mapping.local_heads(cfg.kda_num_heads)
        K = cfg.kda_head_dim
        for layer, pool in caches.kda_state.items():
            pool[handle.slot] = full.kda_state[layer][0, heads.start:heads.stop]
            conv = full.conv_state[layer][0].view(3, -1, full.conv_state[layer].shape[-1])
            caches.conv_state[layer][handle.slot] = conv[:, heads.start * K:heads.stop * K].reshape(-1, conv.shape[-1])
        error = f"transfer failed on rank {self.mapping.rank}" if fail_on_rank == self.mapping.rank else None
        self.pending[request_id] = [2, error]

    def poll(self, wait: bool = False) -> dict[str, str | None]:
        self.waits.append(wait)
        done = {}
        for rid, entry in list(self.pending.items()):
            entry[0] -= 1
            if entry[0] == 0:
                done[rid] = entry[1]
                del self.pending[rid]
        return done

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.pending.pop(request_id, None)


def _serving_world(rank: int, world_size: int, init_method: str, model_dir: str, first_tokens: list[int]) -> dict:
    mapping = Mapping(world_size, rank, dp=2, cp=2)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=OPTIONS.timeout_s)
    try:
        part = build_rank(model_dir, groups, OPTIONS, _FakeReceiver(model_dir, mapping))
        if rank != 0:
            return {"steps": serve_rank(part), "forwards": _forwards(part), **_consensus_of(part),
                    "cancelled": part.transfers.receiver.cancelled}
        driver = WorldDriver(part, heartbeat_s=0.2)
        try:
            return {**_drive(driver, first_tokens), "forwards": _forwards(part), **_consensus_of(part),
                    "cancelled": part.transfers.receiver.cancelled}
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def _forwards(part) -> int:
    return part.num_steps if isinstance(part, Follower) else part.group.num_forwards


def _consensus_of(part) -> dict:
    from helixserve.transceiver.consensus import TransferConsensus

    consensus = part.transfers.consensus
    return {"consensus_type": type(consensus) is TransferConsensus, "group_size": consensus.group_size,
            "num_collectives": consensus.num_collectives}


def _drive(driver: WorldDriver, first_tokens: list[int]) -> dict:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    owners = {}

    def step() -> None:
        for u in driver.step():
            if u.status.finish_reason not in ("error", "abort"):
                tokens.setdefault(u.request_id, []).append(u.token_id)
            if u.is_finished:
                reasons[u.request_id] = u.status.finish_reason

    for step_no in range(4):
        for i, (prompt, params, arrives) in enumerate(REQUESTS):
            if arrives == step_no:
                driver.add_request(f"r{i}", prompt, params)
                owners[f"r{i}"] = driver.life.get(f"r{i}").dp_rank
        if step_no == 1:
            driver.add_request(ABORTED, _prompt(9, 5), SamplingParams(max_tokens=50, temperature=0))
            driver.add_request(HELD, _prompt(10, 4), SamplingParams(max_tokens=2, temperature=0), hold_cache=True)
            for j, (prompt, params) in enumerate(zip(KV_PROMPTS, KV_PARAMS)):
                driver.add_request(f"kv{j}", prompt, params, forced_output_token_ids=[first_tokens[j]],
                                   kv_ticket=_ticket(j, first_tokens[j], failing=j == 1))
                owners[f"kv{j}"] = driver.life.get(f"kv{j}").dp_rank
        step()
    assert driver.abort(ABORTED) and not driver.abort(ABORTED)
    with pytest.raises(ValueError, match="already in the world"):
        driver.add_request("r0", [1], SamplingParams())
    with pytest.raises(ValueError, match="token ids out of range"):
        driver.add_request("bad", [10**6], SamplingParams())
    while driver.has_unfinished_requests():
        step()
    held_stats = driver.stats()
    assert driver.release(HELD) and not driver.release(HELD)
    # alone in an idle world: a reception aborted mid-way is cancelled on every rank of its group
    driver.add_request(KV_ABORTED, KV_PROMPTS[0], KV_PARAMS[0], forced_output_token_ids=[first_tokens[0]],
                       kv_ticket=_ticket(0, first_tokens[0]))
    owners[KV_ABORTED] = driver.life.get(KV_ABORTED).dp_rank
    step()  # the group allocates and starts receiving (it arrives after two polls)
    assert driver.abort(KV_ABORTED)
    step()
    assert driver.stats().num_used_blocks == 0
    time.sleep(0.3)  # idle: the next has_unfinished_requests() asks for a heartbeat step
    assert driver.has_unfinished_requests()
    step()
    step_id = driver._step_id
    return {"tokens": tokens, "reasons": reasons, "owners": owners, "held_stats": held_stats,
            "final_stats": driver.stats(), "rank_stats": driver.rank_stats(), "steps": step_id,
            "kv_failures": {f"kv{j}": driver.kv_failure(f"kv{j}") for j in range(len(KV_PROMPTS))}}


@pytest.fixture(scope="module")
def serving(tiny_checkpoints):
    model_dir = str(tiny_checkpoints[PRESET])
    llm = LLM(model_dir, cache=CACHE)
    kv_expected = [r.token_ids for r in llm.generate(KV_PROMPTS, KV_PARAMS)]
    expected = [r.token_ids for r in llm.generate([p for p, _, _ in REQUESTS], [p for _, p, _ in REQUESTS])]
    results = run_local_world(_serving_world, 4, model_dir, [t[0] for t in kv_expected], timeout_s=180)
    return results, expected, kv_expected


def test_world_requests_equal_single_process(serving) -> None:
    results, expected, _ = serving
    front = results[0]
    for i, want in enumerate(expected):
        assert front["tokens"][f"r{i}"] == want, f"request r{i}"
        assert front["reasons"][f"r{i}"] == "length"
    assert set(front["owners"].values()) == {0, 1}  # attention DP used both CP groups
    assert ABORTED not in front["reasons"] and len(front["tokens"][ABORTED]) < 50  # stopped mid-way
    assert front["held_stats"].num_held == 1 and front["final_stats"].num_held == 0
    assert front["final_stats"].num_used_blocks == 0 and front["final_stats"].num_used_slots == 0
    assert results[2]["steps"] == front["steps"]  # group 1's leader ran every world step (heartbeats too)
    assert len({r["forwards"] for r in results}) == 1 and front["forwards"] > 0  # forwards paired up
    assert sorted(front["rank_stats"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for stats in front["rank_stats"].values():  # every rank's own blocks and slots are free again
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0 and stats.num_blocks > 0


def test_received_kv_decodes_like_single_process(serving) -> None:
    results, _, kv_expected = serving
    front = results[0]
    for j in (0, 2):  # greedy, and seeded sampling (the ctx's first draw is replayed)
        assert front["tokens"][f"kv{j}"] == kv_expected[j]
        assert front["reasons"][f"kv{j}"] == "length"
    assert front["reasons"]["kv1"] == "error" and "kv1" not in front["tokens"]


def test_an_aborted_reception_is_cancelled_on_every_rank_of_its_group(serving) -> None:
    results, _, _ = serving
    group = results[0]["owners"][KV_ABORTED]
    for rank in (2 * group, 2 * group + 1):
        assert results[rank]["cancelled"] == [KV_ABORTED], rank
    assert KV_ABORTED not in results[0]["tokens"] and results[0]["reasons"].get(KV_ABORTED) in (None, "abort")


def test_the_cp_group_agrees_through_the_transceiver_consensus(serving) -> None:
    """kv1's transfer fails on rank 3 only; rank 0 hears its CP group (ranks 2, 3) only through the
    group leader, rank 2, which learns rank 3's cause only through the consensus all-gather."""
    results, _, _ = serving
    front = results[0]
    assert front["owners"]["kv1"] == 1  # the CP group of ranks 2 and 3
    assert front["kv_failures"] == {"kv0": None, "kv1": "transfer failed on rank 3", "kv2": None}
    assert all(r["consensus_type"] and r["group_size"] == 2 for r in results)
    # the ranks of a CP group ran the same collectives (one per step while a transfer was open)
    assert results[0]["num_collectives"] == results[1]["num_collectives"]
    assert results[2]["num_collectives"] == results[3]["num_collectives"] > 0


FAIL_TIMEOUT_S = 10


def _failing_world(rank: int, world_size: int, init_method: str, model_dir: str, report_path: str) -> str:
    mapping = Mapping(world_size, rank, dp=2, cp=2)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=FAIL_TIMEOUT_S)
    part = build_rank(model_dir, groups, OPTIONS)
    if rank == 2:  # group 1's leader
        calls = {"n": 0}
        model = part.runner.model
        forward = model.forward

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault on rank 2")
            return forward(*args, **kwargs)

        model.forward = flaky
    if rank != 0:
        return str(serve_rank(part))
    driver = WorldDriver(part)
    prompts = [_prompt(20 + i, 5) for i in range(4)]
    start = time.monotonic()
    try:
        drive_to_completion(driver, prompts, [SamplingParams(max_tokens=20, temperature=0)] * 4)
    except WorldStoppedError as exc:
        seconds = time.monotonic() - start
        assert not driver.has_unfinished_requests()
        with pytest.raises(WorldStoppedError):
            driver.add_request("after", [1, 2], SamplingParams())
        with open(report_path, "w") as f:
            json.dump({"error": str(exc), "seconds": seconds}, f)
        return "stopped"
    return "no error"


def test_a_failing_rank_stops_the_world(tiny_checkpoints, tmp_path) -> None:
    report = tmp_path / "rank0.json"
    with pytest.raises(LocalWorldError) as info:
        run_local_world(_failing_world, 4, str(tiny_checkpoints[PRESET]), str(report), timeout_s=120, grace_s=15)
    message = str(info.value)
    assert "injected fault on rank 2" in message
    assert "rank 0" not in message.split("failed on ranks")[1].split("\n")[0]  # rank 0 caught its error
    rank0 = json.loads(report.read_text())
    assert "the generation world stopped" in rank0["error"]
    assert rank0["seconds"] < FAIL_TIMEOUT_S + 5, rank0  # within the collective timeout, no hang


def test_cli_world_json_equals_single_process(tiny_checkpoints, capsys) -> None:
    from helixserve.cli import main

    model = str(tiny_checkpoints["kimi-linear-tiny"])
    base = ["generate", "--model", model, "--prompt", "Hello, helix", "--max-tokens", "10", "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--dp", "2", "--cp", "2"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == 10
    assert main(base + ["--dp", "3"]) == 2
    assert "num_experts=8 is not divisible by the world size 3" in capsys.readouterr().err


@pytest.mark.gpu
def test_nccl_world_generates_like_single_process(tiny_checkpoints) -> None:
    """2 GPUs, NCCL, cp = 2, fp32: tokens of the single-process engine on one GPU."""
    from helixserve.launch.offline import generate_many_on_world

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = str(tiny_checkpoints[PRESET])
    prompts = [p for p, _, _ in REQUESTS]
    params = [p for _, p, _ in REQUESTS]
    # the reference runs on a GPU too: seeded sampling draws from the device's generator
    want = [r.token_ids for r in LLM(model, cache=CACHE, device="cuda", dtype="float32").generate(prompts, params)]
    got = generate_many_on_world(model, prompts, params, dp=1, cp=2,
                                 options=WorldOptions(cache=CACHE, dtype="float32", backend="nccl"))
    assert [r.token_ids for r in got] == want


def test_async_engine_drives_a_local_world(tiny_checkpoints) -> None:
    """A server process as rank 0 (start_local_world) behind the real AsyncEngine; an idle gap
    longer than the collective timeout is bridged by heartbeat plans."""
    import asyncio

    from helixserve.engine.async_engine import AsyncEngine
    from helixserve.serving.local_world import start_local_world

    model = str(tiny_checkpoints[PRESET])
    prompts, params = [p for p, _, _ in REQUESTS[:3]], [p for _, p, _ in REQUESTS[:3]]
    want = [r.token_ids for r in LLM(model, cache=CACHE).generate(prompts, params)]
    world = start_local_world(model, dp=1, cp=2, options=WorldOptions(cache=CACHE, timeout_s=10), heartbeat_s=0.5)
    try:
        async def serve() -> list[list[int]]:
            engine = AsyncEngine(world.driver, None, max_num_seqs=CACHE.max_num_seqs, max_queue_len=4)
            engine.start()

            async def run(i: int) -> list[int]:
                return [t async for out in engine.generate(f"a{i}", prompts[i], params[i]) for t in out.token_ids]

            got = list(await asyncio.gather(run(0), run(1)))
            await asyncio.sleep(12.0)  # idle for longer than the 10 s timeout
            got.append(await run(2))
            await engine.shutdown()
            return got

        assert asyncio.run(serve()) == want
        assert world.is_alive()
    finally:
        world.close()
    assert [p.exitcode for p in world.processes] == [0]


def test_a_world_of_one_is_the_single_engine(tiny_checkpoints) -> None:
    """dp 1 x cp 1: the same EngineCore, runner and forward as ``LLM`` (greedy, seeded sampling,
    chunked prefill of a prompt past the step budget): the same tokens and finish reasons."""
    from helixserve.config import SchedulerConfig
    from helixserve.launch.offline import generate_many_on_world

    model = str(tiny_checkpoints[PRESET])
    scheduler = SchedulerConfig(max_num_batched_tokens=16)
    prompts = [p for p, _, _ in REQUESTS] + [_prompt(30, 40)]  # 40 tokens: three prefill chunks
    params = [p for _, p, _ in REQUESTS] + [SamplingParams(max_tokens=6, temperature=0.7, seed=2, ignore_eos=True)]
    want = LLM(model, cache=CACHE, scheduler=scheduler).generate(prompts, params)
    got = generate_many_on_world(model, prompts, params, dp=1, cp=1,
                                 # on the CPU as LLM runs (a world of one would take a GPU where it has one)
                                 options=WorldOptions(cache=CACHE, scheduler=scheduler, timeout_s=30, backend="gloo"))
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]

