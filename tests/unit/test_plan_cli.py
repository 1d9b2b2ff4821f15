"""``helixserve plan`` on the command line: the JSON object (GPU counts per role as integer
``*gpu*`` fields), the table, a deployment config's own mappings, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helixserve.cli import main
from helixserve.models.presets import get_preset
from helixserve.planning.memory import GIB
from helixserve.planning.plan import PlanTarget, plan_configured, smallest_mapping

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helixserve.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_k3_json_gives_the_gpu_counts_per_role():
    out = run_cli("--preset", "kimi-k3", "--gpu-memory-gib", "141", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    gpu_ints = {k: v for k, v in plan.items() if "gpu" in k and isinstance(v, int) and not isinstance(v, bool)}
    assert gpu_ints == {"ctx_gpus": 16, "gen_gpus": 16}
    t = PlanTarget(context_len=32768, batch=16)
    for role in ("ctx", "gen"):
        best = smallest_mapping(get_preset("kimi-k3"), role, 141 * GIB, t)
        r = plan["roles"][role]
        assert (r["num_gpus"], r["dp"], r["cp"], r["fits"]) == (best.num_gpus, best.memory.dp, best.memory.cp, True)
        assert r["per_rank"]["total_bytes"] == best.memory.total_bytes <= 141 * GIB
        assert r["per_rank"]["routed_expert_format"] == "mxfp4"
    assert "serve-ctx runs one process" in plan["roles"]["ctx"]["note"]


def test_table_for_48b(capsys):
    assert main(["plan", "--preset", "kimi-linear-48b", "--gpu-memory-gib", "141", "--context-len", "131072",
                 "--batch", "64"]) == 0
    text = capsys.readouterr().out
    assert "| ctx | dp 1 x cp 1 | 1 |" in text and "| gen | dp 1 x cp 2 | 2 |" in text
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
    expected = plan_configured(get_preset("kimi-k3-tiny"), "gen", 2, 2, 2 * GIB, t, 16, 8)
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
