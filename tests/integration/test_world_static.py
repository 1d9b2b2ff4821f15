"""The static helix step (``WorldOptions(static_moe=True)``, ``HelixHooks.set_static``) on gloo.

- A world in static mode gives exactly the tokens of the default (host-split) mode and of the
  single-process ``LLM`` at dp x cp = 1 x 2 and 2 x 2: a prompt longer than the step's
  token budget (chunked prefill), prompts at the budget's edges, and an idle DP group (one group
  prefills or decodes while the other has finished: its empty steps join the padded all-to-alls
  with the same world-wide capacity). Every rank reports the same capacity rule (dp 1: each
  step's exact ceil(T / cp); dp > 1: ceil(budget / cp) on every step) and that its MLA layers'
  LSE all-to-alls ran in the preallocated buffers.
- A static-mode MoE layer (route, padded dispatch, the kernels' expert sum, combine, finish)
  reads nothing on the host, on a rank with rows and on an idle rank alike; the default mode
  fails the same guard; both give the same output.
- In a world > 1, EngineCore and the followers capture decode CUDA graphs only in static mode.
"""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.rank_setup import decode_graphs_off_reason, step_token_budget
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.spmd.follower import Follower
from helixserve.engine.spmd.driver import drive_to_completion
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank, uses_static_moe
from helixserve.kernels.triton_common import has_fla
from helixserve.launch.processes import run_local_world
from helixserve.models.helix_hooks import static_moe_capacity
from helixserve.models.helix_load import load_helix_model
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.packing import store_column_major
from helixserve.models.presets import get_preset
from helixserve.parallel import Mapping, init_parallel
from tests.integration.host_sync_guard import HostReadError, no_host_reads

PRESET = "kimi-k3-tiny"
BUDGET = 16
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=8, max_num_seqs=4, max_model_len=128)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=BUDGET)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# the long prompt takes 4 steps of prefill while the other group decodes, then the short ones
# finish first and their group idles while the long one decodes on
PROMPTS = [_prompt(1, 3 * BUDGET + 5), _prompt(2, BUDGET - 1), _prompt(3, BUDGET), _prompt(4, BUDGET + 1)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=3, temperature=0.8, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
WORLDS = [(1, 2), (2, 2)]  # no dp 2 x cp 1: the 2 x 2 world runs the static all-to-all across DP groups too


def _options(static: bool) -> WorldOptions:
    return WorldOptions(cache=CACHE, scheduler=SCHEDULER, timeout_s=30, static_moe=static)


def _rank_report(part) -> dict:  # noqa: ANN001
    helix = part.runner.model.helix
    return {"capacity": helix.moe_capacity(1), "per_step": helix.per_step, "lse_buffers": len(helix._lse_store),
            "forwards": part.num_steps if isinstance(part, Follower) else part.group.num_forwards}


def _world(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int, static: bool) -> dict:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=30)
    try:
        part = build_rank(model_dir, groups, _options(static))
        if rank != 0:
            serve_rank(part)
            return _rank_report(part)
        driver = WorldDriver(part)
        try:
            results = drive_to_completion(driver, PROMPTS, PARAMS)
            # alone: the other DP group idles through every step of this one
            alone = drive_to_completion(driver, PROMPTS[:1], PARAMS[:1])
            return {**_rank_report(part), "tokens": [r.token_ids for r in results + alone],
                    "reasons": [r.finish_reason for r in results + alone]}
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


@pytest.fixture(scope="module")
def single(tiny_checkpoints) -> list[list[int]]:
    llm = LLM(tiny_checkpoints[PRESET], cache=CACHE, scheduler=SchedulerConfig(max_num_batched_tokens=1024))
    return [r.token_ids for r in llm.generate(PROMPTS + PROMPTS[:1], PARAMS + PARAMS[:1])]


@pytest.mark.parametrize(("dp", "cp"), WORLDS)
def test_static_world_equals_default_world_and_single_process(tiny_checkpoints, single, dp: int, cp: int) -> None:
    model_dir = str(tiny_checkpoints[PRESET])
    static = run_local_world(_world, dp * cp, model_dir, dp, cp, True, timeout_s=300)
    default = run_local_world(_world, dp * cp, model_dir, dp, cp, False, timeout_s=300)
    assert static[0]["tokens"] == default[0]["tokens"] == single
    assert set(static[0]["reasons"]) == {"length"}
    # dp 1: each step's exact capacity (one of 1 row: 1); dp > 1: the budget's, world-wide
    capacity = 1 if dp == 1 else static_moe_capacity(step_token_budget(CACHE, SCHEDULER), cp)
    assert dp == 1 or capacity == -(-BUDGET // cp)
    assert [(r["capacity"], r["per_step"]) for r in static] == [(capacity, dp == 1)] * (dp * cp)
    assert [r["capacity"] for r in default] == [None] * (dp * cp)
    # every rank ran the same number of forwards (real or empty), in both modes
    assert len({r["forwards"] for r in static}) == 1 and len({r["forwards"] for r in default}) == 1
    if cp > 1:  # the MLA layers' LSE all-to-alls used the preallocated buffers (one set, fp32 packed)
        assert [r["lse_buffers"] for r in static] == [1] * (dp * cp)
    assert [r["lse_buffers"] for r in default] == [0] * (dp * cp)


def test_static_mode_defaults_and_checks() -> None:
    one, two = Mapping(1, 0), Mapping(2, 0, dp=1, cp=2)
    cpu = torch.device("cpu")
    assert not uses_static_moe(WorldOptions(), two, cpu)  # off on the CPU by default (slower eagerly)
    assert uses_static_moe(WorldOptions(static_moe=True), two, cpu)
    assert not uses_static_moe(WorldOptions(static_moe=True), one, cpu)  # a world of one calls no hook
    assert not uses_static_moe(WorldOptions(), two, torch.device("cuda", 0))  # opt-in until run on GPUs
    assert static_moe_capacity(BUDGET + 1, 2) == BUDGET // 2 + 1
    assert static_moe_capacity(BUDGET + 1, 2, "replicated") == BUDGET + 1  # each CP rank routes all T rows
    with pytest.raises(ValueError, match="max_step_tokens=0"):
        static_moe_capacity(0, 2)


def test_a_world_captures_decode_graphs_only_in_static_mode() -> None:
    """EngineCore and the followers ask decode_graphs_off_reason alike; in a world > 1 the answer
    is yes only with the static helix step (and CUDA, graphs asked for, the fast kernels)."""
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset(PRESET), mapping=Mapping(2, 0, dp=1, cp=2))
    assert decode_graphs_off_reason(model, "cpu", True, 2) == "not on CUDA"
    assert decode_graphs_off_reason(model, "cuda", False, 2) == "enforce_eager"
    no_fla = None if has_fla() else "the fast kernels (fla, Triton) are not in use"
    off = decode_graphs_off_reason(model, "cuda", True, 2)
    assert off == (no_fla or "a world of 2 ranks without the static helix step (WorldOptions.static_moe)")
    model.helix.set_static(BUDGET)
    assert decode_graphs_off_reason(model, "cuda", True, 2) == no_fla
    assert [model.helix.moe_capacity(t) for t in (0, 1, 5, BUDGET)] == [1, 1, 3, BUDGET // 2]  # dp 1: per step
    model.helix.set_static(BUDGET, per_step=False)
    assert [model.helix.moe_capacity(t) for t in (0, 5)] == [BUDGET // 2] * 2
    model.helix.set_static(None)
    assert not model.helix.is_static and model.helix.moe_capacity(5) is None
    with torch.device("meta"):
        dp2 = KimiForCausalLM(get_preset(PRESET), mapping=Mapping(2, 0, dp=2, cp=1))
    dp2.helix.set_static(BUDGET)
    assert [dp2.helix.moe_capacity(t) for t in (0, 5)] == [BUDGET] * 2  # dp 2: the budget's, every step
    with pytest.raises(ValueError, match="per-step MoE capacity needs dp == 1"):
        dp2.helix.set_static(BUDGET, per_step=True)


ROWS = (5, 0)  # rank 0 routes 5 rows, rank 1 idles (its empty step)


def _no_host_read_worker(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    torch.manual_seed(0)
    mapping = Mapping(world_size, rank, dp=world_size, cp=1)
    groups = init_parallel(mapping, init_method, backend="gloo", timeout_s=30)
    try:
        model = load_helix_model(model_dir, mapping).bind(groups)
        layer = next(layer for layer in model.model.layers if layer.is_moe)
        experts = layer.block_sparse_moe.experts
        store_column_major(experts, "w13")  # column-major stacks (a CPU world of one's layout): the expert
        store_column_major(experts, "w2")  # sum is the kernels' embedding-bag form, host-free
        hooks = model.helix
        x = torch.randn(ROWS[rank], model.cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
        out: dict = {}
        with torch.inference_mode():
            default = hooks.ffn(layer, x, ROWS[rank]) if ROWS[rank] else hooks.empty_step([layer], x.dtype, x.device)
            with pytest.raises(HostReadError), no_host_reads():  # the guard is real: the host split fails it
                hooks.ffn(layer, x, ROWS[rank]) if ROWS[rank] else hooks.empty_step([layer], x.dtype, x.device)
            hooks.set_static(max(ROWS))
            out["capacity"] = hooks.moe_capacity(ROWS[rank])
            with no_host_reads():
                static = hooks.ffn(layer, x, ROWS[rank]) if ROWS[rank] else hooks.empty_step([layer], x.dtype, x.device)
            if ROWS[rank]:  # capacity - 1: refused before any collective (no peer waits on it)
                hooks.set_static(ROWS[rank] - 1)
                with pytest.raises(ValueError, match=f"{ROWS[rank]} MoE rows on rank 0 exceed the static capacity "
                                                     f"{ROWS[rank] - 1}"):
                    hooks.ffn(layer, x, ROWS[rank])
        if ROWS[rank]:
            out["max_diff"] = (static - default).abs().max().item()
            out["shape"] = tuple(static.shape) == (ROWS[rank], model.cfg.hidden_size)
        return out
    finally:
        groups.destroy()


def test_static_moe_layer_reads_nothing_on_the_host(tiny_checkpoints) -> None:
    results = run_local_world(_no_host_read_worker, 2, str(tiny_checkpoints[PRESET]), timeout_s=120)
    assert results[1] == {"capacity": max(ROWS)}
    assert results[0]["capacity"] == max(ROWS) and results[0]["shape"]
    assert results[0]["max_diff"] <= 1e-5
