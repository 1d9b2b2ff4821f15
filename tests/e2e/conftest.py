"""Real servers on loopback: each process started as ``python -m helixserve.cli <role>`` from a
deployment YAML with free ports, and stopped (process group) when its fixture ends.

The deployment is the default shape: one ctx worker (its KV sender on a free port) and one gen
world of dp 1 x cp 2 (rank 0 is the gen server, rank 1 its child) receiving the KV over UCX.
``baseline_gen=True`` adds a single-process gen worker (dp = cp = 1, ``recompute``) that the
router does not use: the aggregated baseline of the equivalence tests (a dict: that worker's
settings changed, e.g. its ``speculative``). ``extra_ctx=n`` adds n more ctx workers like the first
(processes ``ctx1`` .. ``ctxn``, the router's pool holds them all).

A test module gets its running deployment from the ``dep`` fixture (one per module, stopped when
the module ends). It changes the deployment by overriding ``dep_options`` (the keyword arguments
of :class:`Deployment`) and, to serve another checkpoint, ``dep_checkpoint``. Modules that leave
their deployment as they found it (no role killed or restarted) may instead name a
``SHARED_DEPLOYMENT`` group: the group's modules run one after the other on one deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helixserve.config import DeploymentConfig
from helixserve.config import INTERNAL_SECRET_ENV, RestartPolicy, with_reserved_ports
from helixserve.testing.servers import SECRET_HEADER, free_ports, http, new_secret, trust_workers, wait_until

__all__ = ["MODEL", "REPO", "SECRET_HEADER", "Deployment", "free_ports", "http", "metric", "wait_until"]

REPO = Path(__file__).resolve().parents[2]
MODEL = "kimi-k3-tiny"


def metric(url: str, name: str, default: float | None = None) -> float:
    """The sample ``name`` (with its labels, or the first labeled one) of a ``/metrics`` page."""
    _, text = http("GET", f"{url}/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(f"{name} not in {url}/metrics")


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # exited already, and with it its group


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


class Deployment:
    """ctx + gen workers and a router as subprocesses, from one YAML. ``overrides`` update the
    default deployment's sections: a dict merges into a section (for ``ctx`` and ``gen``: into
    the first worker's entry), anything else replaces it."""

    def __init__(self, tmp: Path, model_dir: Path, baseline_gen: bool | dict[str, Any] = False,
                 extra_ctx: int = 0, **overrides: Any) -> None:
        ctx_port, gen_port, router_port, tx_port, baseline_port, *extra_ports = free_ports(5 + 2 * extra_ctx)
        gen = [{"port": gen_port, "dp": 1, "cp": 2, "kv_source": "ucx", "collective_timeout_s": 30}]
        if baseline_gen:
            baseline = baseline_gen if isinstance(baseline_gen, dict) else {}
            gen.append({"port": baseline_port, "dp": 1, "cp": 1, "kv_source": "recompute", **baseline})
        data: dict[str, Any] = {
            "model": {"path": str(model_dir), "served_name": MODEL},
            "cache": {"tokens_per_block": 4, "memory_budget_mib": 16, "max_num_seqs": 8,
                      "max_model_len": 256},
            "scheduler": {"max_num_batched_tokens": 512},
            "default_max_tokens": 16,
            "ctx": [{"port": ctx_port, "transceiver_port": tx_port, "pickup_timeout_s": 20}],
            "gen": gen,
            "transceiver": {"kv_transfer_timeout_ms": 5000, "rpc_timeout_ms": 1000,
                            "drain_timeout_ms": 1000},
            "router": {"port": router_port, "health_check_interval_s": 0.25,
                       "health_check_timeout_s": 1.0, "gen_urls": [f"http://127.0.0.1:{gen_port}"]},
        }
        for i in range(extra_ctx):
            ports = {"port": extra_ports[2 * i], "transceiver_port": extra_ports[2 * i + 1]}
            data["ctx"].append({**data["ctx"][0], **ports})
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), list):
                data[key] = [{**data[key][0], **value}, *data[key][1:]]
            elif isinstance(value, dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        self.config = DeploymentConfig.model_validate(data)
        self.config_file = tmp / "deployment.yaml"
        self.config.to_yaml(self.config_file)
        self.log_dir = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx_url, self.gen_url = self.config.ctx[0].url, self.config.gen[0].url
        self.ctx_urls = [w.url for w in self.config.ctx]
        self.baseline_url = self.config.gen[1].url if baseline_gen else None
        self.router_url = f"http://127.0.0.1:{router_port}"
        # as `helixserve launch`: one internal secret, given to every process through its env
        self.secret = new_secret()
        trust_workers([*self.ctx_urls, self.gen_url, *([self.baseline_url] if baseline_gen else [])], self.secret)
        extra_roles = [f"ctx{i + 1}" for i in range(extra_ctx)]
        self.roles = ["ctx", *extra_roles, "gen", *(["baseline"] if baseline_gen else []), "router"]

    def save(self) -> None:
        self.config.to_yaml(self.config_file)

    def start(self, role: str, *extra: str, env: dict[str, str] | None = None, name: str | None = None,
              module: str = "helixserve.cli") -> None:
        """Start ``role`` (``ctx``, ``ctx1`` .., ``gen``, ``baseline`` or ``router``) as process ``name``
        (default: the role), with ``env`` added to this environment; ``module``: the CLI to run
        (a test's fault injector wrapping ``helixserve.cli``)."""
        command = {"ctx": ["serve-ctx"], "gen": ["serve-gen"], "baseline": ["serve-gen", "--index", "1"],
                   "router": ["router"]}.get(role) or ["serve-ctx", "--index", role.removeprefix("ctx")]
        name = name or role
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (kept for the process)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, "--log-level", "WARNING", *command,
             "-c", str(self.config_file), *extra],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=self.environment(env))

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """What every process of this deployment starts with, as ``helixserve launch`` gives it:
        the internal secret and the deployment's ports reserved (no process draws another's
        configured port for its own rendezvous before that one binds it), plus ``env``."""
        ports = {port for _, port in self.config.listen_addresses()}
        return with_reserved_ports({**os.environ, INTERNAL_SECRET_ENV: self.secret, **(env or {})}, ports)

    def start_all(self, **ctx: Any) -> Deployment:
        """Start every role and wait until ready; ``ctx``: :meth:`start`'s keyword arguments for
        the ctx role (a fault injector's ``module`` and its ``env``)."""
        for role in self.roles:
            self.start(role, **(ctx if role == "ctx" else {}))
        self.wait_ready()
        self._started = dict(self.procs)
        return self

    def untouched(self) -> bool:
        """Every role still the process :meth:`start_all` started, alive, and the router ready."""
        if self.procs != getattr(self, "_started", None) or any(p.poll() is not None for p in self.procs.values()):
            return False
        try:
            return http("GET", f"{self.router_url}/ready", timeout=5)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120) -> None:
        def up(url: str) -> bool:
            try:
                return http("GET", url, timeout=2)[0] == 200
            except OSError:
                return False

        def ready() -> bool:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{role} exited with {proc.returncode}:\n{self.log(role)}")
            baseline_up = self.baseline_url is None or up(f"{self.baseline_url}/ready")
            return baseline_up and up(f"{self.router_url}/ready")
        wait_until(ready, timeout, "the router's /ready", interval=0.3)

    def extra_router(self, tmp_path: Path, timeout: float = 60, env: dict[str, str] | None = None,
                     **router: Any) -> tuple[str, subprocess.Popen]:
        """A second router over the same workers with ``router`` settings changed (a free port,
        the deployment's secret, ``env`` added); the caller terminates the process."""
        (port,) = free_ports(1)
        config = self.config.model_copy(update={"router": self.config.router.model_copy(
            update={"port": port, **router})})
        path = tmp_path / f"router-{port}.yaml"
        config.to_yaml(path)
        proc = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "router", "-c", str(path)],
                                cwd=REPO, start_new_session=True,
                                env=self.environment(env))
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return http("GET", f"{url}/ready", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(ready, timeout, "the extra router")
        return url, proc

    def start_srun_tasks(self, role: str, num_tasks: int, master_port: int) -> None:
        """Start ``role`` as srun starts a world's step for the SLURM launcher: ``num_tasks``
        processes ``<role>-task<k>`` with SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and
        MASTER_ADDR / MASTER_PORT naming task 0 (the last task first, task 0 last)."""
        for task in reversed(range(num_tasks)):
            self.start(role, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": str(task),
                                  "SLURM_NTASKS": str(num_tasks), "SLURM_LOCALID": str(task),
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)},
                       name=f"{role}-task{task}")

    def kill_task1_and_expect_task0_to_fail(self, role: str) -> None:
        """Kill ``role``'s task 1: task 0 (srun started the ranks, so no restart in place) exits 1
        naming its stopped world and srun / torchrun, for srun / SLURM to restart the step."""
        self.kill(f"{role}-task1")
        assert self.procs[f"{role}-task0"].wait(60) == 1
        log = self.log(f"{role}-task0")
        assert f"the {role} world stopped" in log and "srun / torchrun" in log, log
        self.procs.pop(f"{role}-task0")

    def log(self, role: str) -> str:
        path = self.log_dir / f"{role}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def kill(self, role: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal ``role``'s process group and reap it (SIGKILL after 30 s); a process that already
        exited is only reaped (its group may be gone)."""
        proc = self.procs.pop(role)
        _signal_group(proc, sig)
        _reap(proc)

    def stop(self) -> None:
        """SIGTERM every role's process group at once (the router first: no new traffic), then
        reap each (SIGKILL after 30 s): the roles shut down side by side."""
        roles = sorted(self.procs, key=lambda role: role != "router")
        procs = [self.procs.pop(role) for role in roles]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        for proc in procs:
            _reap(proc)

    def stats(self, role: str) -> dict:
        url = {"ctx": self.ctx_url, "gen": self.gen_url}[role]
        return http("GET", f"{url}/stats")[1]

    def prefill_on_ctx(self, prompt: list[int]) -> dict:
        """A context_only request straight to the ctx worker: its generation_only params."""
        status, answer = http("POST", f"{self.ctx_url}/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only"}})
        assert status == 200 and answer["choices"][0]["finish_reason"] is None, answer
        return {**answer["disaggregated_params"], "request_type": "generation_only"}

    def rank_pids(self) -> list[int]:
        """The gen world's spawned ranks (1 .. dp*cp-1), from the gen worker's /health."""
        return http("GET", f"{self.gen_url}/health")[1]["world"]["rank_pids"][1:]

    def is_idle(self) -> bool:
        """Nothing in use or in flight on any ctx worker (sender included) and gen."""
        gen = self.stats("gen")
        return all(ctx["num_used_blocks"] == ctx["num_used_slots"] == ctx["num_held"] == 0
                   and ctx["pickups_held"] == 0 and ctx["kv_transfers_in_flight"] == 0
                   for ctx in (http("GET", f"{url}/stats")[1] for url in self.ctx_urls)) and (
            gen["num_used_blocks"] == gen["num_used_slots"] == gen["num_live_requests"] == 0)

    def client(self, url: str | None = None, api_key: str = "none", timeout: float = 60):  # noqa: ANN201
        import openai

        internal = {} if url in (None, self.router_url) else {SECRET_HEADER: self.secret}
        return openai.OpenAI(base_url=f"{url or self.router_url}/v1", api_key=api_key,
                             max_retries=0, timeout=timeout, default_headers=internal)


@pytest.fixture(scope="module")
def k3_tiny(tiny_checkpoints) -> Path:
    return tiny_checkpoints[MODEL]


@pytest.fixture(scope="module")
def dep_checkpoint(k3_tiny) -> Path:
    """The checkpoint the module's ``dep`` serves (a module overrides this fixture for another)."""
    return k3_tiny


# a SHARED_DEPLOYMENT group's deployment. "disagg": the router -> ctx -> gen world default plus the
# single-process baseline gen worker (recompute) that the router does not use; its gen world
# restarts quickly (up to 5 times), for the group's last module (test_supervision) kills ranks
SHARED_OPTIONS: dict[str, dict[str, Any]] = {
    "disagg": {"baseline_gen": True, "gen": {"world_restart": RestartPolicy(max_restarts=5, backoff_s=0.2)}}}


@pytest.fixture(scope="module")
def dep_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The module's :class:`Deployment` keyword arguments (a module overrides this fixture);
    none: the default deployment, or its ``SHARED_DEPLOYMENT`` group's :data:`SHARED_OPTIONS`."""
    return dict(SHARED_OPTIONS.get(_group(request.module) or "", {}))


# (group, checkpoint, options) -> the deployment the last module of a SHARED_DEPLOYMENT group left running
_SHARED: dict[tuple[str, str, str], Deployment] = {}


def _group(module: Any) -> str | None:
    return getattr(module, "SHARED_DEPLOYMENT", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The e2e modules that name one ``SHARED_DEPLOYMENT`` group run one after the other (at the
    place of the group's first module; every other module keeps its place), so that they share
    one deployment."""
    rank: dict[object, int] = {}
    for item in items:
        module = getattr(item, "module", None)
        key = _group(module) or module
        rank.setdefault(key, len(rank))
    items.sort(key=lambda item: rank[_group(getattr(item, "module", None)) or getattr(item, "module", None)])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Once the last module of a group ended, its shared deployment stops."""
    group = _group(getattr(nextitem, "module", None)) if nextitem is not None else None
    for key in [k for k in _SHARED if k[0] != group]:
        _SHARED.pop(key).stop()


def pytest_sessionfinish() -> None:
    """No shared deployment outlives the session (e.g. one stopped at a failure with -x)."""
    for key in list(_SHARED):
        _SHARED.pop(key).stop()


@pytest.fixture(scope="module")
def dep(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, dep_checkpoint: Path,
        dep_options: dict[str, Any]) -> Iterator[Deployment]:
    """The module's deployment, every role started and ready; stopped when the module ends.

    A module that sets ``SHARED_DEPLOYMENT = "<group>"`` shares it with the group's other modules
    of the same checkpoint and options: the next one gets it still running if every role the
    deployment started is still the process it started and the router is ready (else a fresh
    one). Such a module's checks of cumulative counters take their values at its start."""
    group = _group(request.module)
    key = (group, str(dep_checkpoint), repr(sorted(dep_options.items()))) if group else None
    d = _SHARED.pop(key, None) if key else None
    if d is not None and not d.untouched():
        d.stop()
        d = None
    if d is None:
        name = group or request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        d = Deployment(tmp_path_factory.mktemp(name), dep_checkpoint, **dep_options).start_all()
    yield d
    if key is not None and d.untouched():
        _SHARED[key] = d
    else:
        d.stop()
