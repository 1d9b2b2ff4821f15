"""helixserve.launch.slurm without a cluster: SLURM variables, placement defaults and errors,
resolved hosts, and the srun command lines of every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.config import DeploymentConfig
from helixserve.config_env import slurm_env_from
from helixserve.launch.slurm import Placement, place, plan_steps, role_args


def deployment(num_ctx: int = 1, gens: tuple[tuple[int, int], ...] = ((1, 2),), device: str = "cpu"
               ) -> DeploymentConfig:
    return DeploymentConfig(
        model={"path": "/models/tiny", "device": device},
        ctx=[{"port": 8100 + i, "transceiver_port": 18100 + i} for i in range(num_ctx)],
        gen=[{"port": 8200 + j, "dp": dp, "cp": cp} for j, (dp, cp) in enumerate(gens)],
    )


def test_slurm_env_from_batch_and_step_variables() -> None:
    env = slurm_env_from({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_SUBMIT_DIR": "/w"})
    assert (env.job_id, env.nodelist, env.procid, env.ntasks, env.submit_dir) == ("42", "n[1-2]", 0, 1, "/w")
    env = slurm_env_from({"SLURM_JOBID": "7", "SLURM_NODELIST": "a", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert (env.job_id, env.procid, env.ntasks) == ("7", 1, 2)


@pytest.mark.parametrize("environ, message", [
    ({}, "not inside a SLURM job"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a", "SLURM_PROCID": "x"}, "must be integers"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a", "SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, "outside"),
])
def test_slurm_env_from_rejects(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slurm_env_from(environ)


def test_default_placement_one_node_and_many() -> None:
    deploy = deployment(num_ctx=2, gens=((1, 2), (2, 1), (1, 1)))
    one = Placement().resolve(deploy, 1)
    assert (one.router, one.ctx, one.gen) == (0, [0, 0], [[0], [0], [0]])
    three = Placement().resolve(deploy, 3)
    assert (three.router, three.ctx, three.gen) == (0, [0, 0], [[1], [2], [1]])


@pytest.mark.parametrize("placement, message", [
    ({"ctx": [0, 0]}, "lists 2 ctx / 1 gen entries; the config has 1 ctx / 1 gen"),
    ({"gen": [[0, 1, 2]]}, "cannot spread evenly"),
    ({"router": 5}, "node indexes \\[5\\]"),
    ({"gen": [[]]}, "cannot spread evenly"),
])
def test_placement_errors(placement: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(**placement).resolve(deployment(), 2)


def test_place_binds_each_server_to_its_node_and_ports_must_not_clash() -> None:
    deploy = deployment(num_ctx=2)
    placement = Placement(ctx=[0, 1], gen=[[2]], router=1).resolve(deploy, 3)
    placed = place(deploy, placement, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert [w.host for w in placed.ctx] == ["10.0.0.1", "10.0.0.2"]
    assert [w.transceiver_host for w in placed.ctx] == ["10.0.0.1", "10.0.0.2"]
    assert placed.gen[0].host == "10.0.0.3" and placed.router.host == "10.0.0.2"
    assert placed.ctx_urls == ("http://10.0.0.1:8100", "http://10.0.0.2:8101")
    clash = DeploymentConfig(model={"path": "/m"}, ctx=[{"host": "a", "port": 8100}],
                             gen=[{"host": "b", "port": 8100}])  # fine apart, not on one node
    with pytest.raises(ValueError, match="ports used twice"):
        place(clash, Placement().resolve(clash, 1), ["n1"])


def test_plan_steps_cpu_world_over_two_nodes() -> None:
    deploy = deployment(num_ctx=1, gens=((2, 2),))
    placement = Placement(gen=[[1, 2]], rdzv_port=29600).resolve(deploy, 3)
    hosts = ["n1", "n2", "n3"]
    placed = place(deploy, placement, hosts)
    steps = plan_steps(placed, placement, hosts, Path("/job/config.yaml"), python="/py")
    assert [s.name for s in steps] == ["ctx0", "gen0", "router"]
    ctx, gen, router = steps
    assert ctx.argv[-7:] == ["--log-level", "WARNING", "serve-ctx", "--index", "0", "-c", "/job/config.yaml"]
    assert (gen.nodes, gen.num_tasks) == (["n2", "n3"], 4)
    assert gen.exports == {"MASTER_ADDR": "n2", "MASTER_PORT": "29600"}
    for flag in ("--nodes=2", "--ntasks=4", "--nodelist=n2,n3", "--overlap", "--label",
                 "--export=ALL,MASTER_ADDR=n2,MASTER_PORT=29600"):
        assert flag in gen.argv
    srun_part = gen.argv[:gen.argv.index("/py")]
    assert srun_part[0] == "srun" and all(a.startswith("--") for a in srun_part[1:])
    assert "--nodelist=n1" in router.argv and router.argv[-3:] == ["router", "-c", "/job/config.yaml"]
    assert [args for _, args in role_args(placed)] == [
        ["serve-ctx", "--index", "0"], ["serve-gen", "--index", "0"], ["router"]]


def test_plan_steps_gpu_steps_get_gpus_and_exclusive_cpus() -> None:
    deploy = deployment(device="cuda")
    placement = Placement(cpus_per_task=4).resolve(deploy, 1)
    placed = place(deploy, placement, ["g1"])
    ctx, gen, router = plan_steps(placed, placement, ["g1"], Path("/c.yaml"))
    for step in (ctx, gen):
        assert "--gpus-per-task=1" in step.argv and "--cpus-per-task=4" in step.argv
        assert "--overlap" not in step.argv
    assert "--overlap" in router.argv and not any("gpu" in a for a in router.argv)


def test_gpu_workers_see_only_their_step_gpus() -> None:
    deploy = DeploymentConfig(model={"path": "/m", "device": "cpu"},
                              ctx=[{"port": 8100, "device": "cuda:0"}], gen=[{"port": 8200, "device": "cuda:1"}])
    placement = Placement().resolve(deploy, 2)
    placed = place(deploy, placement, ["g1", "g2"])
    assert (placed.ctx[0].device, placed.gen[0].device) == ("cuda", "cuda")
    steps = plan_steps(placed, placement, ["g1", "g2"], Path("/c.yaml"))
    assert ["--gpus-per-task=1" in s.argv for s in steps] == [True, True, False]


def test_the_internal_secret_reaches_the_steps_by_environment_only(tmp_path: Path, monkeypatch) -> None:
    """The launcher's secret (made when the job has none) is in every step's environment (srun
    --export=ALL passes it on), never in the srun command lines, their exports or config.yaml."""
    import sys

    from helixserve.config import (INTERNAL_SECRET_ENV, INTERNAL_SECRET_FILE_ENV, child_environment,
                                   ensure_internal_secret)
    from helixserve.launch.slurm import Job, Step

    monkeypatch.delenv(INTERNAL_SECRET_ENV, raising=False)
    monkeypatch.delenv(INTERNAL_SECRET_FILE_ENV, raising=False)
    deploy = ensure_internal_secret(place(deployment(), Placement().resolve(deployment(), 1), ["n1"]))
    secret = deploy.security.secret
    assert secret and len(secret) >= 40
    steps = plan_steps(deploy, Placement().resolve(deploy, 1), ["n1"], tmp_path / "config.yaml")
    assert all(secret not in " ".join(s.argv) and secret not in str(s.exports) for s in steps)
    deploy.to_yaml(tmp_path / "config.yaml")
    assert secret not in (tmp_path / "config.yaml").read_text()
    probe = [sys.executable, "-c", f"import os; print(os.environ.get({INTERNAL_SECRET_ENV!r}))"]
    job = Job([Step("ctx0", ["n1"], 1, probe)], tmp_path / "logs", child_environment(deploy))
    job.start()
    assert job.processes["ctx0"].wait(30) == 0
    assert (tmp_path / "logs" / "ctx0.log").read_text().strip() == secret


def test_single_process_workers_naming_one_device_on_one_node_share_its_steps_device() -> None:
    from helixserve.launch.slurm import shared_gpu_steps

    def workers(ctx_device: str, gen_device: str, cp: int = 1) -> DeploymentConfig:
        return DeploymentConfig(model={"path": "/m", "device": "cpu"},
                                ctx=[{"port": 8100, "device": ctx_device}, {"port": 8101, "transceiver_port": 18101}],
                                gen=[{"port": 8200, "device": gen_device, "dp": 1, "cp": cp}])

    same = workers("cuda:0", "cuda:0")
    assert shared_gpu_steps(same, Placement().resolve(same, 1)) == {"ctx0", "gen0"}
    assert shared_gpu_steps(same, Placement().resolve(same, 2)) == set()  # gen on node 1
    bare = workers("cuda", "cuda:0")  # "cuda" is cuda:0
    assert shared_gpu_steps(bare, Placement().resolve(bare, 1)) == {"ctx0", "gen0"}
    apart = workers("cuda:0", "cuda:1")
    assert shared_gpu_steps(apart, Placement().resolve(apart, 1)) == set()
    world = workers("cuda:0", "cuda:0", cp=2)  # a world's ranks take cuda:SLURM_LOCALID
    assert shared_gpu_steps(world, Placement().resolve(world, 1)) == set()
    placement = Placement().resolve(same, 1)
    steps = plan_steps(place(same, placement, ["n1"]), placement, ["n1"], Path("/c.yaml"),
                       shared_gpu=shared_gpu_steps(same, placement))
    assert ["--overlap" in s.argv for s in steps] == [True, True, True, True]  # ctx1 and router: CPU
    assert ["--gpus-per-task=1" in s.argv for s in steps] == [True, False, True, False]


def test_a_ctx_world_is_one_step_of_tp_tasks_with_its_own_rendezvous() -> None:
    """ctx[0] of tp 2 (ctx[1] of one rank): one srun step of 2 tasks whose MASTER_ADDR / MASTER_PORT
    name its node and the port after the gen worlds'; on GPUs one GPU per task, never shared."""
    deploy = DeploymentConfig(model={"path": "/m", "device": "cuda"},
                              ctx=[{"port": 8100, "tp": 2}, {"port": 8101, "transceiver_port": 18102}],
                              gen=[{"port": 8200, "dp": 1, "cp": 2}, {"port": 8201, "dp": 1, "cp": 1}])
    placement = Placement(rdzv_port=29600).resolve(deploy, 2)
    placed = place(deploy, placement, ["n1", "n2"])
    steps = {s.name: s for s in plan_steps(placed, placement, ["n1", "n2"], Path("/c.yaml"), python="/py")}
    ctx0, ctx1 = steps["ctx0"], steps["ctx1"]
    assert (ctx0.nodes, ctx0.num_tasks, ctx1.num_tasks) == (["n1"], 2, 1)
    assert ctx0.exports == {"MASTER_ADDR": "n1", "MASTER_PORT": "29602"} and ctx1.exports == {}
    assert steps["gen0"].exports["MASTER_PORT"] == "29600" and steps["gen1"].exports["MASTER_PORT"] == "29601"
    for flag in ("--ntasks=2", "--nodes=1", "--label", "--gpus-per-task=1", "--export=ALL,MASTER_ADDR=n1,MASTER_PORT=29602"):
        assert flag in ctx0.argv
    assert ctx0.argv[-5:] == ["serve-ctx", "--index", "0", "-c", "/c.yaml"]
    shared = DeploymentConfig(model={"path": "/m", "device": "cuda:0"}, ctx=[{"port": 8100, "tp": 2}],
                              gen=[{"port": 8200, "dp": 1, "cp": 1}])
    from helixserve.launch.slurm import shared_gpu_steps

    assert shared_gpu_steps(shared, Placement().resolve(shared, 1)) == set()  # its ranks: cuda:SLURM_LOCALID


def test_rendezvous_ports_past_the_last_port_are_refused() -> None:
    deploy = DeploymentConfig(model={"path": "/m"}, ctx=[{"port": 8100, "tp": 2}], gen=[{"port": 8200}])
    last = Placement(rdzv_port=65534).resolve(deploy, 1)  # gen0 on 65534, ctx0 on 65535
    assert last.rendezvous(place(deploy, last, ["n1"]))["ctx0"] == {"MASTER_ADDR": "n1", "MASTER_PORT": "65535"}
    with pytest.raises(ValueError, match="rdzv_port 65535: the worlds' rendezvous ports would run to 65536"):
        Placement(rdzv_port=65535).resolve(deploy, 1)
