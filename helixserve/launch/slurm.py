"""Start a deployment inside a SLURM allocation (the body of ``deploy/slurm/helixserve.sbatch``).

1. Read the allocation (:func:`helixserve.config.slurm_env`, parsed in :mod:`helixserve.config_env`): ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``
   (expanded by ``scontrol show hostnames``), ``SLURM_PROCID`` / ``SLURM_NTASKS``: only task 0
   launches, any other task returns at once.
2. Place the roles on nodes (:class:`Placement`, node indexes into the host list): by default
   the router and the ctx workers on node 0 and the gen worlds round-robin over the other nodes
   (node 0 too when the job has one node). Multi-node is a placement file, nothing else.
3. Resolve the deployment YAML as ``helixserve launch`` does (absolute model path, the tiny
   checkpoint made when missing), then put each worker on its node (``host`` = the node's name),
   validate, and write ``config.yaml`` and ``plan.json`` into the job directory.
4. Start one ``srun`` step per ctx worker (tp tasks: a ctx world of tp > 1 is one step), per
   gen world (dp x cp tasks), each world's ``MASTER_ADDR`` / ``MASTER_PORT`` naming its rank 0
   (gloo on CPU, NCCL on GPU with one GPU per task), and for the router, each running
   ``python -m helixserve.cli <role> --index I -c <job dir>/config.yaml``, the commands
   ``helixserve launch`` runs. Logs go to ``<job dir>/logs/<step>.log``. The deployment's
   internal secret (``HELIXSERVE_INTERNAL_SECRET`` / ``_FILE`` of the job, else a fresh random
   one) reaches every step through its environment (``srun --export=ALL``), never a file.
5. Wait (bounded) for the router's ``/ready``; write its URL to ``<job dir>/ready``.
6. Serve until a signal (``scancel``, the time limit via ``--signal``) or until a step exits,
   then stop every step: SIGTERM (srun forwards it to its tasks), a bounded grace, SIGKILL.
   Whatever is left dies with the job.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from helixserve.config import (DeploymentConfig, child_environment, ensure_internal_secret, load_yaml, slurm_env,
                               with_reserved_ports)
from helixserve.config_env import SlurmEnv
from helixserve.launch.local import resolve_deployment
from helixserve.launch.probe import is_ready

logger = logging.getLogger(__name__)

# internal tick: how often the job checks its steps and the router's /ready (the bounds are
# launch.slurm.ready_timeout_s / stop_grace_s)
SUPERVISE_TICK_S = 0.5


def _scontrol(timeout_s: float, *args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, text=True, capture_output=True,
                          timeout=timeout_s).stdout


def expand_nodelist(nodelist: str, timeout_s: float) -> list[str]:
    """``"n[01-02],gpu7"`` -> ``["n01", "n02", "gpu7"]``, by ``scontrol show hostnames``
    (``timeout_s``: ``launch.slurm.scontrol_timeout_s``)."""
    hosts = _scontrol(timeout_s, "show", "hostnames", nodelist).split()
    if not hosts:
        raise ValueError(f"`scontrol show hostnames {nodelist}` listed no hosts")
    return hosts


def node_addresses(hosts: list[str], timeout_s: float) -> list[str]:
    """Each node's ``NodeAddr`` (how SLURM itself reaches it; the name when it has none)."""
    found: dict[str, str] = {}
    for line in _scontrol(timeout_s, "-o", "show", "node", ",".join(hosts)).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return [found.get(h, h) for h in hosts]


class Placement(BaseModel):
    """Which node (index into the job's host list) runs what; ``None`` lists take the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    router: int = Field(0, ge=0)
    ctx: list[int] | None = None  # one node per ctx worker (a ctx world's tp ranks all on it)
    gen: list[list[int]] | None = None  # the nodes of each gen world; its ranks spread evenly
    # gen world j rendezvous on rdzv_port + j, ctx world i (tp > 1) on rdzv_port + len(gen) + i
    rdzv_port: int = Field(29500, ge=1, le=65535)
    # servers listen on / are reached at each node's NodeAddr, or at its host name
    address: Literal["node_addr", "hostname"] = "node_addr"
    cpus_per_task: int = Field(1, ge=1)  # GPU steps only; CPU steps share the job's CPUs

    @classmethod
    def from_yaml(cls, path: str | Path | None) -> Placement:
        return cls.model_validate(load_yaml(path)) if path else cls()

    def resolve(self, deploy: DeploymentConfig, num_nodes: int) -> Placement:
        """Fill the defaults for ``num_nodes`` and check every index and list length."""
        ctx = self.ctx if self.ctx is not None else [0] * len(deploy.ctx)
        gen_pool = list(range(1, num_nodes)) or [0]
        gen = self.gen if self.gen is not None else [[gen_pool[j % len(gen_pool)]] for j in range(len(deploy.gen))]
        if len(ctx) != len(deploy.ctx) or len(gen) != len(deploy.gen):
            raise ValueError(f"placement lists {len(ctx)} ctx / {len(gen)} gen entries; the config has "
                             f"{len(deploy.ctx)} ctx / {len(deploy.gen)} gen workers")
        for j, (nodes, server) in enumerate(zip(gen, deploy.gen)):
            if not nodes or len(nodes) > server.dp * server.cp or (server.dp * server.cp) % len(nodes):
                raise ValueError(f"gen[{j}]: {server.dp * server.cp} ranks cannot spread evenly over "
                                 f"nodes {nodes}")
        bad = [i for i in [self.router, *ctx, *(n for nodes in gen for n in nodes)] if i >= num_nodes]
        if bad:
            raise ValueError(f"placement names node indexes {sorted(set(bad))}; the job has {num_nodes} nodes")
        last_port = self.rdzv_port + len(deploy.gen) + len(deploy.ctx) - 1
        if last_port > 65535:
            raise ValueError(f"rdzv_port {self.rdzv_port}: the worlds' rendezvous ports would run to {last_port} "
                             "(> 65535)")
        return self.model_copy(update={"ctx": ctx, "gen": gen})

    def rendezvous(self, deploy: DeploymentConfig) -> dict[str, dict[str, str]]:
        """Each world step's ``MASTER_ADDR`` / ``MASTER_PORT`` (its rank 0's node, for a ``deploy``
        already through :func:`place`): every gen world, every ctx world of tp > 1."""
        exports = {f"gen{j}": {"MASTER_ADDR": w.host, "MASTER_PORT": str(self.rdzv_port + j)}
                   for j, w in enumerate(deploy.gen)}
        exports |= {f"ctx{i}": {"MASTER_ADDR": w.host, "MASTER_PORT": str(self.rdzv_port + len(deploy.gen) + i)}
                    for i, w in enumerate(deploy.ctx) if w.tp > 1}
        return exports


def on_gpu(deploy: DeploymentConfig, worker_device: str | None) -> bool:
    return (worker_device or deploy.model.device).startswith("cuda")


def place(deploy: DeploymentConfig, placement: Placement, hosts: list[str]) -> DeploymentConfig:
    """The deployment with every server bound to (and reached at) its node's address.

    A GPU worker's ``cuda:N`` becomes ``cuda``: its step sees only the GPUs SLURM gave it, and a
    world's rank (gen, or ctx of ``tp > 1``) picks ``cuda:SLURM_LOCALID`` among them.
    """
    assert placement.ctx is not None and placement.gen is not None, "resolve the placement first"
    data = deploy.model_dump(mode="json")
    for worker, node in zip(data["ctx"], placement.ctx):
        worker["host"] = worker["transceiver_host"] = hosts[node]
    for worker, nodes in zip(data["gen"], placement.gen):
        worker["host"] = hosts[nodes[0]]  # rank 0 serves HTTP
    for worker in (*data["ctx"], *data["gen"]):
        if on_gpu(deploy, worker["device"]):
            worker["device"] = "cuda"
    data["router"]["host"] = hosts[placement.router]
    return DeploymentConfig.model_validate(data)


def shared_gpu_steps(deploy: DeploymentConfig, placement: Placement) -> frozenset[str]:
    """The steps of single-process GPU workers that name one GPU (the same ``cuda:N``) on one
    node, e.g. ctx and gen of deploy/configs/gpu1.yaml; ``deploy`` before :func:`place`. Their
    steps share the GPU (``srun --overlap``: steps share every resource, GPUs included)."""
    assert placement.ctx is not None and placement.gen is not None, "resolve the placement first"
    keys: dict[str, tuple[int, str]] = {}
    for i, (worker, node) in enumerate(zip(deploy.ctx, placement.ctx)):
        if on_gpu(deploy, worker.device) and worker.tp == 1:
            keys[f"ctx{i}"] = (node, _cuda_index(worker.device or deploy.model.device))
    for j, (worker, nodes) in enumerate(zip(deploy.gen, placement.gen)):
        if on_gpu(deploy, worker.device) and worker.world_size == 1:
            keys[f"gen{j}"] = (nodes[0], _cuda_index(worker.device or deploy.model.device))
    values = list(keys.values())
    return frozenset(name for name, key in keys.items() if values.count(key) > 1)


def _cuda_index(device: str) -> str:
    return device.partition(":")[2] or "0"


def role_args(deploy: DeploymentConfig) -> list[tuple[str, list[str]]]:
    """(step name, ``helixserve`` arguments before ``-c FILE``) per process, as launch runs them."""
    steps = [(f"ctx{i}", ["serve-ctx", "--index", str(i)]) for i in range(len(deploy.ctx))]
    steps += [(f"gen{j}", ["serve-gen", "--index", str(j)]) for j in range(len(deploy.gen))]
    return [*steps, ("router", ["router"])]


@dataclass(slots=True)
class Step:
    """One ``srun`` job step."""

    name: str
    nodes: list[str]
    num_tasks: int
    argv: list[str]  # the srun command line
    exports: dict[str, str] = field(default_factory=dict)


def plan_steps(deploy: DeploymentConfig, placement: Placement, hosts: list[str], config_file: Path,
               python: str = sys.executable, log_level: str = "WARNING",
               shared_gpu: frozenset[str] = frozenset()) -> list[Step]:
    """Step 4's srun command lines (router last), for a ``deploy`` already through :func:`place`;
    ``shared_gpu``: steps that share their GPU (:func:`shared_gpu_steps`)."""
    assert placement.ctx is not None and placement.gen is not None, "resolve the placement first"
    gpu_steps = [on_gpu(deploy, w.device) for w in (*deploy.ctx, *deploy.gen)] + [False]
    node_sets = ([[hosts[n]] for n in placement.ctx] + [[hosts[n] for n in nodes] for nodes in placement.gen]
                 + [[hosts[placement.router]]])
    tasks = [w.tp for w in deploy.ctx] + [w.dp * w.cp for w in deploy.gen] + [1]
    rendezvous = placement.rendezvous(deploy)
    steps = []
    for (name, args), nodes, num_tasks, is_gpu in zip(role_args(deploy), node_sets, tasks, gpu_steps):
        exports = rendezvous.get(name, {})
        srun = ["srun", f"--job-name={name}", f"--nodes={len(nodes)}", f"--ntasks={num_tasks}",
                f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1",
                "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in exports.items())])]
        if num_tasks > 1:
            srun.append("--label")
        if is_gpu:
            # exclusive CPUs and GPUs per step, one GPU per task (a world's rank each); every task
            # of a node sees the step's GPUs there, so rank r uses cuda:SLURM_LOCALID
            srun += [f"--cpus-per-task={placement.cpus_per_task}", "--gpus-per-task=1", "--gpu-bind=none"]
            if name in shared_gpu:  # one GPU for several steps (sbatch --gpus-per-node=1)
                srun.append("--overlap")
        else:
            # CPU steps (and the router) share the job's CPUs, even more tasks than CPUs
            srun += ["--overlap", "--overcommit"]
        command = [python, "-m", "helixserve.cli", "--log-level", log_level, *args, "-c", str(config_file)]
        steps.append(Step(name, nodes, num_tasks, [*srun, *command], exports))
    return steps


class Job:
    """The running steps; :meth:`stop` is idempotent."""

    def __init__(self, steps: list[Step], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.steps = steps
        self.log_dir = log_dir
        self.env = env  # srun --export=ALL passes it on to every task (the internal secret)
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for step in self.steps:
            with open(self.log_dir / f"{step.name}.log", "ab") as log:
                self.processes[step.name] = subprocess.Popen(step.argv, stdout=log, stderr=subprocess.STDOUT,
                                                             stdin=subprocess.DEVNULL, env=self.env)
            logger.info("started %s on %s: %s", step.name, ",".join(step.nodes), " ".join(step.argv))

    def exited(self) -> list[tuple[str, int]]:
        return [(name, p.returncode) for name, p in self.processes.items() if p.poll() is not None]

    def stop(self, grace_s: float) -> None:
        """Router first, then the workers: SIGTERM, wait up to ``grace_s``, SIGKILL."""
        for name in ["router", *(s.name for s in self.steps if s.name != "router")]:
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("step %s still running after %.0f s; SIGKILL", name, grace_s)
                process.kill()
                process.wait()


def log_tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m helixserve.launch.slurm", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=None, help="deployment YAML (default: helixserve launch's)")
    p.add_argument("--model", default=None, help="checkpoint directory (overrides model.path)")
    p.add_argument("--port", type=int, default=None, help="router port (overrides router.port)")
    p.add_argument("--placement", default=None, help="placement YAML (see Placement)")
    p.add_argument("--job-dir", default=None, help="default: <submit dir>/helixserve-job-<job id>")
    p.add_argument("--ready-timeout", type=float, default=None,
                   help="seconds to wait for /ready (default: launch.slurm.ready_timeout_s)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds between SIGTERM and SIGKILL (default: launch.slurm.stop_grace_s)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def prepare(args: argparse.Namespace, env: SlurmEnv) -> tuple[DeploymentConfig, list[Step], Path]:
    """Steps 1-3 and the step plan; writes config.yaml and plan.json into the job directory."""
    job_dir = Path(args.job_dir or Path(env.submit_dir or ".") / f"helixserve-job-{env.job_id}").resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    deploy = resolve_deployment(args.config, args.model, args.port)
    scontrol_timeout_s = deploy.launch.slurm.scontrol_timeout_s
    hosts = expand_nodelist(env.nodelist, scontrol_timeout_s)
    placement = Placement.from_yaml(args.placement).resolve(deploy, len(hosts))
    addresses = node_addresses(hosts, scontrol_timeout_s) if placement.address == "node_addr" else hosts
    shared_gpu = shared_gpu_steps(deploy, placement)
    deploy = place(deploy, placement, addresses)
    config_file = job_dir / "config.yaml"
    deploy.to_yaml(config_file)
    steps = plan_steps(deploy, placement, hosts, config_file, log_level=args.log_level, shared_gpu=shared_gpu)
    plan = {"job_id": env.job_id, "hosts": hosts, "addresses": addresses, "placement": placement.model_dump(),
            "router_url": router_url(deploy), "steps": [asdict(s) for s in steps]}
    (job_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    return deploy, steps, job_dir


def router_url(deploy: DeploymentConfig) -> str:
    return f"http://{deploy.router.host}:{deploy.router.port}"


def serve(job: Job, url: str, job_dir: Path, ready_timeout_s: float, stop_signals: list[int],
          probe_timeout_s: float) -> int:
    """Steps 5-6 until a signal (0) or a failure (1); the caller stops the job."""
    deadline = time.monotonic() + ready_timeout_s
    ready = False
    while not stop_signals:
        dead = job.exited()
        if dead:
            name, code = dead[0]
            print(f"helixserve-slurm: step {name} exited with code {code}"
                  f"{'' if ready else ' before the router was ready'}; stopping. Its log:\n"
                  f"{log_tail(job.log_dir / f'{name}.log')}", file=sys.stderr, flush=True)
            return 1
        if not ready and is_ready(url, probe_timeout_s):
            ready = True
            (job_dir / "ready").write_text(url + "\n")
            print(f"helixserve-slurm: ready at {url} (job dir {job_dir})", flush=True)
        elif not ready and time.monotonic() > deadline:
            print(f"helixserve-slurm: the router at {url} was not ready within {ready_timeout_s:.0f} s; "
                  f"logs in {job.log_dir}", file=sys.stderr, flush=True)
            return 1
        time.sleep(SUPERVISE_TICK_S)
    print(f"helixserve-slurm: signal {stop_signals[0]}; stopping", flush=True)
    return 0


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = slurm_env(environ)
    if env.procid != 0:
        return 0  # one launcher per job: task 0
    stop_signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: stop_signals.append(signum))
    deploy, steps, job_dir = prepare(args, env)
    timeouts = deploy.launch.slurm
    ready_timeout_s = timeouts.ready_timeout_s if args.ready_timeout is None else args.ready_timeout
    stop_grace_s = timeouts.stop_grace_s if args.grace is None else args.grace
    # the job's internal secret: HELIXSERVE_INTERNAL_SECRET(_FILE) when the job has one, else made
    # here; it reaches the steps through their environment only (not config.yaml nor plan.json)
    # and every port of the job reserved, the worlds' rendezvous ports too (parallel.ports)
    rendezvous = {int(s.exports["MASTER_PORT"]) for s in steps if "MASTER_PORT" in s.exports}
    step_env = with_reserved_ports(child_environment(ensure_internal_secret(deploy)), rendezvous)
    job = Job(steps, job_dir / "logs", step_env)
    try:
        job.start()
        return serve(job, router_url(deploy), job_dir, ready_timeout_s, stop_signals,
                     deploy.launch.ready_probe_timeout_s)
    finally:
        job.stop(stop_grace_s)
        (job_dir / "ready").unlink(missing_ok=True)
        print("helixserve-slurm: stopped", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"helixserve-slurm: error: {exc}", file=sys.stderr)
        sys.exit(2)
