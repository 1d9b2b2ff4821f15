"""The SLURM deployment on a real single-node cluster (deploy/slurm/testing/: munged, slurmctld,
slurmd started here, stopped at the end): sbatch deploy/slurm/helixserve.sbatch with the tiny
model on CPU, wait for the router's /ready, ask with the `openai` client and get the answers the
local launcher (`helixserve launch`, same config) gives, scancel, and find no process of the job
left. Also: a step that dies ends the job with nothing left, srun starts a gen world's ranks
with a working rendezvous (gloo all_reduce over SLURM_PROCID/SLURM_NTASKS/MASTER_ADDR), and a
ctx world of tp 2 is one step of two tasks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from helixserve.testing.servers import free_ports

REPO = Path(__file__).resolve().parents[2]
TESTING = REPO / "deploy" / "slurm" / "testing"
SBATCH = REPO / "deploy" / "slurm" / "helixserve.sbatch"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
PROMPTS = ["Hello, helix", "The quick brown fox jumps over the lazy dog, then the dog sleeps all day long."]

pytestmark = pytest.mark.slow


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # the test's environment plus SLURM_CONF

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def with_env(self, **env: str) -> Cluster:
        """This cluster, its commands run with ``env`` added (e.g. a job's internal secret)."""
        return Cluster(self.root, {**self.env, **env})


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"SLURM tools {missing} not installed (CI runs deploy/ci/install_system_deps.sh)")
    if os.geteuid() != 0:
        pytest.skip("the single-node test cluster runs slurmd as root (CI runs as root)")
    root = tmp_path_factory.mktemp("slurm")
    began = time.monotonic()
    started = subprocess.run([str(TESTING / "start.sh"), str(root)], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"cluster did not start:\n{started.stderr}"
    print(f"\nslurm test cluster up in {time.monotonic() - began:.1f} s ({started.stderr.strip()})")
    cluster = Cluster(root, {**os.environ, "SLURM_CONF": str(root / "etc" / "slurm.conf")})
    try:
        yield cluster
    finally:
        began = time.monotonic()
        stopped = subprocess.run([str(TESTING / "stop.sh"), str(root), "--keep"], capture_output=True, text=True,
                                 timeout=120)
        print(f"\nslurm test cluster stopped in {time.monotonic() - began:.1f} s")
        assert stopped.returncode == 0, f"cluster left processes behind:\n{stopped.stderr}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(path: Path, checkpoint: Path, ports: list[int] | None = None) -> int:
    """A one-ctx, one-gen tiny deployment on ``ports`` (4; default: free ones); returns the router port."""
    router_port, ctx_port, transceiver_port, gen_port = ports or free_ports(4)  # distinct (one at a time may repeat)
    config = {
        "model": {"path": str(checkpoint), "served_name": "kimi-k3-tiny"},
        "cache": {"memory_budget_mib": 64, "max_num_seqs": 16},
        "ctx": [{"port": ctx_port, "transceiver_port": transceiver_port}],
        "gen": [{"port": gen_port}],
        "router": {"port": router_port},
    }
    path.write_text(yaml.safe_dump(config))
    return router_port


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def answers(url: str) -> list[tuple]:
    """Greedy and seeded completions: (text, finish_reason, prompt tokens, completion tokens)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    out = []
    for prompt in PROMPTS:
        for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
            r = client.completions.create(model="kimi-k3-tiny", prompt=prompt, max_tokens=12, **sampling)
            out.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens,
                        r.usage.completion_tokens))
    return out


def local_launcher_answers(config: Path, router_port: int, log: Path) -> list[tuple]:
    url = f"http://127.0.0.1:{router_port}"
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c", str(config),
                                     "--ready-timeout", "150"], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not is_ready(url):
            assert launcher.poll() is None, f"helixserve launch exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"helixserve launch not ready in 180 s:\n{log.read_text()}"
            time.sleep(0.3)
        return answers(url)
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def job_state(cluster: Cluster, job_id: str) -> str:
    """squeue's state, or "" once the job left the queue."""
    return cluster.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()


def job_processes(job_id: str) -> list[str]:
    """Live processes of the job: its environment names it, or a step daemon of it."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            if "\nState:\tZ" in status:
                continue  # exited, not yet reaped
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in environ or cmdline.startswith(f"slurmstepd: [{job_id}."):
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found


def submit(cluster: Cluster, work: Path, *launcher_args: str) -> str:
    result = cluster.run("sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out",
                         f"--export=ALL,HELIX_PYTHON={sys.executable}", str(SBATCH), *launcher_args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_for_ready(cluster: Cluster, job_id: str, job_dir: Path, output: Path, timeout_s: float) -> None:
    """Until the launcher wrote ``<job dir>/ready``; the job leaving the queue first fails."""
    deadline = time.monotonic() + timeout_s
    while not (job_dir / "ready").is_file():
        state = job_state(cluster, job_id)
        assert state in {"PENDING", "CONFIGURING", "RUNNING"}, (
            f"job {job_id} is {state or 'gone'} before /ready:\n{output.read_text() if output.exists() else ''}")
        assert time.monotonic() < deadline, f"job {job_id} not ready in {timeout_s:.0f} s:\n{output.read_text()}"
        time.sleep(0.3)


def wait_until_gone(cluster: Cluster, job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while job_state(cluster, job_id):
        assert time.monotonic() < deadline, f"job {job_id} still queued after {timeout_s} s"
        time.sleep(0.3)


def assert_nothing_left(job_id: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job_id} still running:\n" + "\n".join(left)


def test_sbatch_serves_the_local_launchers_answers_and_scancel_leaves_nothing(
        slurm_cluster: Cluster, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "deployment.yaml"
    ports = free_ports(8)
    router_port = write_config(config, tiny_checkpoints["kimi-k3-tiny"], ports[:4])
    local = tmp_path / "local.yaml"  # the same deployment on other ports: launched while the job starts
    local_port = write_config(local, tiny_checkpoints["kimi-k3-tiny"], ports[4:])

    job_dir = tmp_path / "job"
    began = time.monotonic()
    job_id = submit(slurm_cluster, tmp_path, "-c", str(config), "--job-dir", str(job_dir),
                    "--ready-timeout", "150", "--grace", "5")
    output = tmp_path / f"slurm-{job_id}.out"
    try:
        expected = local_launcher_answers(local, local_port, tmp_path / "launch.log")
    except BaseException:
        slurm_cluster.run("scancel", job_id)
        raise
    wait_for_ready(slurm_cluster, job_id, job_dir, output, 200)
    url = (job_dir / "ready").read_text().strip()
    print(f"\njob {job_id} ready at {url} {time.monotonic() - began:.1f} s after sbatch")
    assert url.endswith(f":{router_port}")
    assert (job_dir / "config.yaml").is_file() and (job_dir / "plan.json").is_file()

    assert answers(url) == expected

    began = time.monotonic()
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    wait_until_gone(slurm_cluster, job_id, 60)
    assert_nothing_left(job_id)
    print(f"job {job_id} cancelled, nothing left, in {time.monotonic() - began:.1f} s")
    assert not is_ready(url)
    assert "helixserve-slurm: stopped" in output.read_text()


def test_a_step_that_dies_ends_the_job_with_nothing_left(
        slurm_cluster: Cluster, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "deployment.yaml"
    write_config(config, tiny_checkpoints["kimi-k3-tiny"])
    data = yaml.safe_load(config.read_text())
    with socket.socket() as taken:  # the gen worker's port is taken: serve-gen cannot bind
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", data["gen"][0]["port"]))
        taken.listen()
        job_id = submit(slurm_cluster, tmp_path, "-c", str(config), "--job-dir", str(tmp_path / "job"),
                        "--ready-timeout", "150", "--grace", "5")
        wait_until_gone(slurm_cluster, job_id, 200)
    assert_nothing_left(job_id)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "step gen0 exited" in output and "helixserve-slurm: stopped" in output, output
    assert not (tmp_path / "job" / "ready").exists()
    state = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert "JobState=FAILED" in state, state  # the launcher exits 1


PROBE = """
import os, torch, torch.distributed as dist
from helixserve.parallel.groups import dist_env_from
env = dist_env_from(os.environ)
dist.init_process_group("gloo", init_method=env.init_method, rank=env.rank, world_size=env.world_size)
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)
print(f"rank {env.rank}/{env.world_size} at {env.init_method}: sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_srun_starts_a_gen_worlds_ranks_with_its_rank0_rendezvous(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """The gen step exactly as the launcher plans it (dp 1 x cp 2), running a gloo all_reduce."""
    from helixserve.config import DeploymentConfig
    from helixserve.launch.slurm import Placement, node_addresses, place, plan_steps

    hosts = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N").stdout.split()[:1]
    deploy = DeploymentConfig(model={"path": "/unused"}, gen=[{"dp": 1, "cp": 2}])
    placement = Placement(rdzv_port=free_port()).resolve(deploy, 1)
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = slurm_cluster.env["SLURM_CONF"]  # node_addresses asks scontrol
    try:
        placed = place(deploy, placement, node_addresses(hosts, deploy.launch.slurm.scontrol_timeout_s))
    finally:
        os.environ.pop("SLURM_CONF") if old_conf is None else os.environ.update(SLURM_CONF=old_conf)
    gen = next(s for s in plan_steps(placed, placement, hosts, tmp_path / "c.yaml") if s.name == "gen0")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    srun = gen.argv[:gen.argv.index(sys.executable)]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nexec " + " ".join([*srun, sys.executable, str(probe)]) + "\n")
    result = slurm_cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/out-%j.txt",
                               str(script))
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    wait_until_gone(slurm_cluster, job_id, 120)
    lines = sorted(line for line in (tmp_path / f"out-{job_id}.txt").read_text().splitlines() if "rank " in line)
    address = f"tcp://{placed.gen[0].host}:{placement.rdzv_port}"
    assert lines == [f"0: rank 0/2 at {address}: sum 3", f"1: rank 1/2 at {address}: sum 3"], lines
    assert_nothing_left(job_id)


# ids avoid the word "gpu": conftest skips tests with that keyword when CUDA is missing
@pytest.mark.parametrize("config, shared", [("gpu1.yaml", {"ctx0", "gen0"}), ("gpu2.yaml", set())],
                         ids=["one_device", "two_devices"])
def test_the_sbatch_cuda_configs_plan_steps_that_share_or_split_the_devices(
        config: str, shared: set[str], tiny_checkpoints: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/configs/gpu1.yaml and gpu2.yaml through the launcher's own preparation (no cluster:
    the one-node host list is given): both load, move the KV over UCX, and their ctx and gen steps
    each get a GPU; gpu1's two steps share one (srun --overlap), gpu2's do not."""

    from helixserve.config import DeploymentConfig
    from helixserve.config_env import slurm_env_from
    from helixserve.launch import slurm

    path = REPO / "deploy" / "configs" / config
    assert all(g.kv_source == "ucx" for g in DeploymentConfig.from_yaml(path).gen)
    monkeypatch.setattr(slurm, "expand_nodelist", lambda nodelist, timeout_s: ["g1"])  # scontrol needs a cluster
    placement = tmp_path / "placement.yaml"
    placement.write_text("address: hostname\ncpus_per_task: 4\n")
    args = slurm.parse_args(["-c", str(path), "--model", str(tiny_checkpoints["kimi-k3-tiny"]),
                             "--placement", str(placement), "--job-dir", str(tmp_path / "job")])
    deploy, steps, job_dir = slurm.prepare(args, slurm_env_from({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "g1"}))
    assert (deploy.ctx[0].device, deploy.gen[0].device) == ("cuda", "cuda")  # each step sees its own GPUs
    assert deploy.gen[0].kv_source == "ucx"
    planned = {s["name"]: s["argv"] for s in json.loads((job_dir / "plan.json").read_text())["steps"]}
    assert planned == {s.name: s.argv for s in steps}
    for name in ("ctx0", "gen0"):
        assert "--gpus-per-task=1" in planned[name] and "--cpus-per-task=4" in planned[name]
        assert ("--overlap" in planned[name]) == (name in shared), planned[name]
    assert not any("gpu" in a for a in planned["router"])
    assert DeploymentConfig.from_yaml(job_dir / "config.yaml").gen[0].kv_source == "ucx"


def test_sbatch_runs_a_ctx_world_as_one_step_of_two_tasks(
        slurm_cluster: Cluster, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A deployment whose ctx worker is a world of tp 2 (gloo, CPU) beside a recompute gen worker:
    its step is 2 srun tasks (task 0 serves, task 1 is rank 1: no rank spawned), the router gets
    ready, the ctx world answers plain requests as the gen worker does, the router's
    ``context_only`` hop is its 400 naming tp, and scancel leaves nothing."""
    from helixserve.testing.servers import SECRET_HEADER, http

    config = tmp_path / "deployment.yaml"
    router_port = write_config(config, tiny_checkpoints["kimi-k3-tiny"])
    data = yaml.safe_load(config.read_text())
    data["ctx"][0].update(tp=2, collective_timeout_s=60)
    data["gen"][0].update(dp=1, cp=1, kv_source="recompute")
    config.write_text(yaml.safe_dump(data))
    placement = tmp_path / "placement.yaml"
    placement.write_text(f"rdzv_port: {free_port()}\n")
    secret = "k" * 48
    job_dir = tmp_path / "job"
    job_id = submit(slurm_cluster.with_env(HELIXSERVE_INTERNAL_SECRET=secret), tmp_path, "-c", str(config),
                    "--placement", str(placement), "--job-dir", str(job_dir), "--ready-timeout", "150", "--grace", "5")
    output = tmp_path / f"slurm-{job_id}.out"
    wait_for_ready(slurm_cluster, job_id, job_dir, output, 200)
    url = (job_dir / "ready").read_text().strip()
    placed = yaml.safe_load((job_dir / "config.yaml").read_text())
    ctx_url = f"http://{placed['ctx'][0]['host']}:{placed['ctx'][0]['port']}"
    gen_url = f"http://{placed['gen'][0]['host']}:{placed['gen'][0]['port']}"
    health = http("GET", f"{ctx_url}/health")[1]
    assert health["world"] == {"dp": 1, "cp": 2, "rank_pids": [None], "failure": None, "restarts": 0}, health
    assert "--ntasks=2" in next(s for s in json.loads((job_dir / "plan.json").read_text())["steps"]
                                if s["name"] == "ctx0")["argv"]
    body = {"model": "kimi-k3-tiny", "prompt": list(range(3, 20)), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    auth = {SECRET_HEADER: secret}
    got = http("POST", f"{ctx_url}/v1/completions", body, headers=auth, timeout=120)
    want = http("POST", f"{gen_url}/v1/completions", body, headers=auth, timeout=120)
    assert got[0] == want[0] == 200 and got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"], (got, want)
    status, routed = http("POST", f"{url}/v1/completions", body, timeout=120)  # context_only hop, then gen
    assert status == 200 and routed["choices"][0]["text"] == want[1]["choices"][0]["text"], routed
    assert slurm_cluster.run("scancel", job_id).returncode == 0
    wait_until_gone(slurm_cluster, job_id, 60)
    assert_nothing_left(job_id)
    assert "helixserve-slurm: stopped" in output.read_text()
