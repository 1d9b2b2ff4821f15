"""``helixserve plan`` on the command line: the JSON object (GPU counts per role as integer
``*gpu*`` fields), the table, a deployment config's own mappings, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helixserve.config import CacheConfig
from helixserve.cli import main
from helixserve.models.presets import get_preset
from helixserve.planning.memory import GIB
from helixserve.planning.plan import PlanTarget, plan_configured, plan_filled, smallest_mapping

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helixserve.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_k3_json_gives_the_gpu_counts_per_role():
    out = run_cli("--preset", "kimi-k3", "--gpu-memory-gib", "141", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    gpu_ints = {k: v for k, v in plan.items() if "gpu" in k and isinstance(v, int) and not isinstance(v, bool)}
    assert gpu_ints == {"ctx_gpus": 16, "gen_gpus": 16} and plan["ctx_tp"] == 16
    t = PlanTarget(context_len=32768, batch=16)
    for role in ("ctx", "gen"):
        best = smallest_mapping(get_preset("kimi-k3"), role, 141 * GIB, t)
        r = plan["roles"][role]
        assert (r["num_gpus"], r["dp"], r["cp"], r["fits"]) == (best.num_gpus, best.memory.dp, best.memory.cp, True)
        assert r["per_rank"]["total_bytes"] == best.memory.total_bytes <= 141 * GIB
        assert r["per_rank"]["routed_expert_format"] == "mxfp4"
    assert "ctx[].tp" in plan["roles"]["ctx"]["note"] and "its own shard" in plan["roles"]["ctx"]["note"]
    assert (plan["roles"]["ctx"]["tp"], plan["roles"]["ctx"]["ep"]) == (16, 16) and "tp" not in plan["roles"]["gen"]


def test_table_for_48b(capsys):
    assert main(["plan", "--preset", "kimi-linear-48b", "--gpu-memory-gib", "141", "--context-len", "131072",
                 "--batch", "64"]) == 0
    text = capsys.readouterr().out
    assert "| ctx | tp 1 (ep 1) | 1 |" in text and "| gen | dp 1 x cp 2 | 2 |" in text
    assert "| 46 | yes |" in text and "| 180 | yes |" in text


def test_a_deployment_config_is_planned_as_the_servers_size_it(tmp_path, tiny_checkpoints, capsys):
    config = {"model": {"path": str(tiny_checkpoints["kimi-k3-tiny"])},
              "cache": {"tokens_per_block": 4, "memory_budget_mib": 16, "max_num_seqs": 8, "gpu_memory_gib": 2},
              "scheduler": {"max_num_batched_tokens": 256}, "gen": [{"dp": 2, "cp": 2}]}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", "-c", str(path), "--context-len", "1024", "--batch", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    gen = plan["config"]["gen"]
    t = PlanTarget(context_len=1024, batch=4, tokens_per_block=4, max_num_batched_tokens=256)
    expected = plan_configured(get_preset("kimi-k3-tiny"), "gen", 2, 2, 2 * GIB, t,
                               CacheConfig(tokens_per_block=4, memory_budget_mib=16, max_num_seqs=8))
    assert (gen["dp"], gen["cp"], gen["per_rank"]["num_blocks"]) == (2, 2, expected.memory.pools.num_blocks)
    assert gen["sequences_at_context"] == expected.sequences == 16 and gen["fits"]
    assert plan["gpu_memory_gib"] == 2.0 and plan["model"] == "kimi-k3-tiny"


def test_a_checkpoint_directory_is_planned_from_its_config(tiny_checkpoints, capsys):
    model = tiny_checkpoints["kimi-linear-tiny"]
    assert main(["plan", "--model", str(model), "--gpu-memory-gib", "2", "--context-len", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = smallest_mapping(get_preset("kimi-linear-tiny"), "gen", 2 * GIB, PlanTarget(context_len=4096, batch=16))
    assert (plan["model"], plan["gen_gpus"], plan["ctx_gpus"]) == ("kimi-linear-tiny", 1, 1)
    assert plan["roles"]["gen"]["sequences_at_context"] == best.sequences > 16


@pytest.mark.parametrize(("args", "message"), [
    (["--preset", "kimi-k3"], "give --gpu-memory-gib"),
    (["--gpu-memory-gib", "141"], "give --preset NAME, --model DIR or -c CONFIG"),
    (["--preset", "kimi-k3", "--gpu-memory-gib", "-1"], "must be positive"),
    (["--preset", "nope", "--gpu-memory-gib", "141"], "unknown preset 'nope'"),
    (["--model", "/nonexistent", "--gpu-memory-gib", "141"], "no config.json in /nonexistent"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_model_that_fits_nowhere_says_so(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--gpu-memory-gib", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ctx_gpus"] is None and plan["gen_gpus"] is None and plan["roles"]["gen"] is None


def test_k3_ctx_layouts_are_every_tp_its_heads_and_experts_divide_over(capsys):
    """K3: 96 KDA / MLA heads and 896 experts divide over tp 1, 2, 4, 8, 16, 32 (gcd 32); on 141 GiB
    GPUs the shard fits from tp 16 on (the smallest: the ctx layout above), tp 8 is short by the
    bytes it names."""
    assert main(["plan", "--preset", "kimi-k3", "--gpu-memory-gib", "141", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layouts = plan["ctx_layouts"]
    assert [(c["tp"], c["ep"], c["fits"]) for c in layouts] == [
        (1, 1, False), (2, 2, False), (4, 4, False), (8, 8, False), (16, 16, True), (32, 32, True)]
    t = PlanTarget(context_len=32768, batch=16)
    for c in layouts:
        expected = plan_filled(get_preset("kimi-k3"), "ctx", 1, c["tp"], 141 * GIB, t)
        assert (c["total_bytes"], c["shortfall_bytes"]) == (expected.memory.total_bytes, expected.memory.shortfall_bytes)
        assert (c["shortfall_bytes"] > 0) == (not c["fits"]) and c["problems"] == []
    assert plan["ctx_tp"] == min(c["tp"] for c in layouts if c["fits"]) == plan["roles"]["ctx"]["cp"]
    assert main(["plan", "--preset", "kimi-k3", "--gpu-memory-gib", "141"]) == 0
    text = capsys.readouterr().out
    assert "| ctx | tp 16 (ep 16) | 16 |" in text and "| 8 | 8 | 219.1 | 78.1 | 0 | no |" in text
    assert "| 16 | 16 | 141.0 | - | 127 | yes |" in text


@pytest.mark.parametrize(("preset", "tps"), [("kimi-k3-tiny", [1, 2, 4]), ("kimi-linear-48b", [1, 2, 4, 8, 16, 32])])
def test_ctx_layouts_leave_out_every_tp_the_model_cannot_take(preset, tps, capsys):
    assert main(["plan", "--preset", preset, "--gpu-memory-gib", "141", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["ctx_layouts"]
    assert [c["tp"] for c in layouts] == tps
    assert all(not get_preset(preset).helix_mapping_problems(1, c["tp"]) for c in layouts)


def _config(tmp_path, model, ctx_tp: int, gpu_gib: float) -> Path:
    config = {"model": {"path": str(model)},
              "cache": {"tokens_per_block": 4, "memory_budget_mib": 16, "max_num_seqs": 8, "gpu_memory_gib": gpu_gib},
              "scheduler": {"max_num_batched_tokens": 256}, "ctx": [{"tp": ctx_tp}],
              "gen": [{"dp": 1, "cp": 2, "kv_source": "recompute"}]}
    path = tmp_path / f"deploy-{ctx_tp}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_configs_ctx_world_is_checked_against_the_gpu(tmp_path, tiny_checkpoints, tp, capsys):
    path = _config(tmp_path, tiny_checkpoints["kimi-k3-tiny"], tp, 2)
    assert main(["plan", "-c", str(path), "--context-len", "1024", "--ctx-batch", "2", "--json"]) == 0
    ctx = json.loads(capsys.readouterr().out)["config"]["ctx"]
    t = PlanTarget(context_len=1024, ctx_batch=2, tokens_per_block=4, max_num_batched_tokens=256)
    expected = plan_configured(get_preset("kimi-k3-tiny"), "ctx", 1, tp, 2 * GIB, t,
                               CacheConfig(tokens_per_block=4, memory_budget_mib=16, max_num_seqs=8))
    assert (ctx["tp"], ctx["ep"], ctx["num_gpus"], ctx["per_rank"]["total_bytes"]) == (
        tp, tp, tp, expected.memory.total_bytes)
    assert ctx["fits"] and ctx["problems"] == []


def test_a_configs_ctx_world_the_gpu_cannot_hold_names_the_shortfall(tmp_path, tiny_checkpoints, capsys):
    path = _config(tmp_path, tiny_checkpoints["kimi-k3-tiny"], 2, 0.01)  # 10 MiB GPUs: the 16 MiB pools alone do not fit
    assert main(["plan", "-c", str(path), "--context-len", "64", "--json"]) == 0
    ctx = json.loads(capsys.readouterr().out)["config"]["ctx"]
    assert ctx["tp"] == 2 and not ctx["fits"] and ctx["per_rank"]["shortfall_bytes"] > 0


def test_a_configs_ctx_world_the_heads_do_not_divide_over_is_named(tmp_path, tiny_checkpoints, capsys):
    path = _config(tmp_path, tiny_checkpoints["kimi-k3-tiny"], 3, 2)
    assert main(["plan", "-c", str(path), "--context-len", "64", "--json"]) == 0
    ctx = json.loads(capsys.readouterr().out)["config"]["ctx"]
    assert not ctx["fits"] and any("not divisible by cp=3" in p for p in ctx["problems"]), ctx["problems"]
