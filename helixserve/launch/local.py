"""``helixserve launch``: the router, ctx and gen workers on this machine from one YAML.

1. Resolve the config: ``-c FILE``, else the built-in local one (tiny model on CPU, one ctx
   worker, one gen world of dp 1 x cp 2 receiving the KV over UCX); ``--model`` / ``--port``
   override. A missing checkpoint
   at the default path, or at a path named after a preset, is made first (random weights).
2. Write the resolved config to a temporary file and start every worker and the router as
   ``python -m helixserve.cli <role> -c FILE --index I``, each in its own process group and
   set to receive SIGTERM if the launcher dies (Linux), so nothing outlives it (the ranks of a
   gen world or a ctx world of ``tp > 1`` are its worker's own child processes, in its group).
3. Wait until the router's ``/ready`` answers 200, at most ``ready_timeout_s``; a process that
   exits first fails the launch, naming it and its exit code.
4. Print the URL and a ``curl`` example, then wait for SIGINT/SIGTERM, supervising: a process
   that exits is started again (its group's leftovers killed first) after the backoff of
   ``launch.restart``, at most ``max_restarts`` times within ``window_s`` per process; one more
   exit (or any exit with ``launch.restart_children: false`` / ``--no-restart``) stops the
   deployment and ``launch`` exits 1.
5. Stop: SIGTERM to every process group, wait up to 15 s, SIGKILL what is left.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from helixserve.config import (CacheConfig, DeploymentConfig, GenServerConfig, child_environment,
                               ensure_internal_secret)
from helixserve.launch.restarts import RestartBudget
from helixserve.launch.probe import is_ready

DEFAULT_MODEL_DIR = Path("checkpoints/kimi-k3-tiny")
DEFAULT_PRESET = "kimi-k3-tiny"
_PR_SET_PDEATHSIG = 1
# internal tick: how often the launcher checks its children and the router's /ready (the waits'
# bounds are launch.ready_timeout_s / stop_grace_s)
SUPERVISE_TICK_S = 0.3
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_deployment(model_dir: Path = DEFAULT_MODEL_DIR) -> DeploymentConfig:
    """deploy/configs/local.yaml's values: one ctx worker, one gen world of dp 1 x cp 2 (the
    config defaults) receiving the KV over UCX."""
    return DeploymentConfig(model={"path": model_dir, "served_name": DEFAULT_PRESET},
                            cache=CacheConfig(memory_budget_mib=64, max_num_seqs=16),
                            gen=[GenServerConfig(dp=1, cp=2, kv_source="ucx")])


def resolve_deployment(config: str | Path | None, model: str | None, port: int | None
                       ) -> DeploymentConfig:
    """Steps 1: the config with overrides and an absolute model path; makes a tiny checkpoint
    when the path is missing and is the default or named after a preset."""
    deploy = DeploymentConfig.from_yaml(config) if config else default_deployment()
    spec = deploy.model
    path = Path(model) if model else spec.path
    if not (path / "config.json").is_file() and spec.load_format != "dummy":
        from helixserve.models.presets import PRESETS, make_checkpoint

        preset = path.name if path.name in PRESETS else None
        if preset is None and path == DEFAULT_MODEL_DIR:
            preset = DEFAULT_PRESET
        if preset is None:
            raise FileNotFoundError(f"no checkpoint at {path} (no config.json); make one with "
                                    f"`helixserve make-checkpoint --preset {DEFAULT_PRESET} --out {path}`")
        print(f"making the {preset} checkpoint (random weights) at {path}", flush=True)
        make_checkpoint(preset, path, seed=0)
    spec = spec.model_copy(update={"path": path.resolve(), "served_name": spec.name})
    router = deploy.router.model_copy(update={"port": port}) if port else deploy.router
    return DeploymentConfig.model_validate({**deploy.model_dump(), "model": spec.model_dump(),
                                            "router": router.model_dump()})


def with_restart_overrides(deploy: DeploymentConfig, restart: bool | None, max_restarts: int | None
                           ) -> DeploymentConfig:
    """The ``launch`` section with the CLI's ``--no-restart`` / ``--max-restarts`` applied."""
    section = deploy.launch.model_dump()
    if restart is not None:
        section["restart_children"] = restart
    if max_restarts is not None:
        section["restart"]["max_restarts"] = max_restarts
    return DeploymentConfig.model_validate({**deploy.model_dump(), "launch": section})


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the process groups are still stopped on a normal exit


@dataclass
class Child:
    """One started role: ``args`` start it again (its restarts counted in ``budget``)."""

    name: str
    args: list[str]
    process: subprocess.Popen
    budget: RestartBudget
    restart_at: float | None = None  # it exited: when to start it again


def child_commands(deploy: DeploymentConfig) -> list[tuple[str, list[str]]]:
    """``(name, helixserve arguments)`` of every worker, then the router."""
    commands = [(f"ctx[{i}] {w.url}", ["serve-ctx", "--index", str(i)]) for i, w in enumerate(deploy.ctx)]
    commands += [(f"gen[{i}] {w.url}", ["serve-gen", "--index", str(i)]) for i, w in enumerate(deploy.gen)]
    commands.append((f"router http://{deploy.router.host}:{deploy.router.port}", ["router"]))
    return commands


def spawn(args: list[str], config_file: Path, log_level: str, deploy: DeploymentConfig) -> subprocess.Popen:
    """Start one child: ``python -m helixserve.cli ARGS -c FILE`` in its own process group, set
    to receive SIGTERM if the launcher dies, the internal secret in its environment (every child,
    first start and restarts, starts here)."""
    command = [sys.executable, "-m", "helixserve.cli", "--log-level", log_level, *args, "-c", str(config_file)]
    return subprocess.Popen(command, cwd=_REPO_ROOT, env=child_environment(deploy), start_new_session=True,
                            preexec_fn=_die_with_parent)


def start_processes(config_file: Path, deploy: DeploymentConfig, log_level: str) -> list[Child]:
    """Step 2: every worker, then the router."""
    return [Child(name, args, spawn(args, config_file, log_level, deploy), RestartBudget(deploy.launch.restart))
            for name, args in child_commands(deploy)]


def supervise(children: list[Child], deploy: DeploymentConfig, config_file: Path, log_level: str,
              now: float | None = None) -> str | None:
    """Step 4, once: start again each child whose backoff passed; note each that exited (its
    process group's leftovers are killed, its restart is scheduled). Returns why the deployment
    must stop (restarts off, or a child exceeded its restarts), else None."""
    now = time.monotonic() if now is None else now
    policy = deploy.launch.restart
    for child in children:
        if child.restart_at is not None:
            if now >= child.restart_at:
                print(f"restarting {child.name}", flush=True)
                child.process, child.restart_at = spawn(child.args, config_file, log_level, deploy), None
            continue
        code = child.process.poll()
        if code is None:
            continue
        _signal_group(child, signal.SIGKILL)  # what it left behind (e.g. a gen world's ranks)
        if not deploy.launch.restart_children:
            return f"{child.name} exited with code {code}; stopping (launch.restart_children is off)"
        delay = child.budget.next_delay()
        if delay is None:
            return (f"{child.name} exited with code {code} and exceeded its restarts "
                    f"(launch.restart.max_restarts={policy.max_restarts} within {policy.window_s:g} s); "
                    f"stopping")
        print(f"{child.name} exited with code {code}; restarting it in {delay:g} s "
              f"({child.budget.describe()})", file=sys.stderr, flush=True)
        child.restart_at = now + delay
    return None


def stop_processes(children: list[Child], timeout_s: float) -> None:
    """Step 5: SIGTERM, up to ``timeout_s`` (``launch.stop_grace_s``), SIGKILL."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child, signal.SIGKILL)  # leftovers in the group, if any
        child.process.wait()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_ready(url: str, children: list[Child], timeout_s: float, should_stop,  # noqa: ANN001
               probe_timeout_s: float) -> None:
    """Step 3; raises ``RuntimeError`` naming a process that exited or the timeout."""
    deadline = time.monotonic() + timeout_s
    while not is_ready(url, probe_timeout_s):
        for child in children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with code {code} before the router was ready")
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router at {url} was not ready within {timeout_s:.0f} s")
        time.sleep(SUPERVISE_TICK_S)


def curl_example(url: str, deploy: DeploymentConfig) -> str:
    body = json.dumps({"model": deploy.model.name, "prompt": "Hello, helix", "max_tokens": 16})
    auth = " -H 'Authorization: Bearer <key>'" if deploy.router.api_keys else ""
    return f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def launch(config: str | None, model: str | None = None, port: int | None = None,
           log_level: str = "WARNING", ready_timeout_s: float | None = None, restart: bool | None = None,
           max_restarts: int | None = None) -> int:
    """Steps 1-5; ``ready_timeout_s`` / ``restart`` / ``max_restarts`` override the config's
    ``launch`` section (``None``: the config's value)."""
    deploy = ensure_internal_secret(
        with_restart_overrides(resolve_deployment(config, model, port), restart, max_restarts))
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_signals.append(signum))
    if ready_timeout_s is None:
        ready_timeout_s = deploy.launch.ready_timeout_s
    url = f"http://{deploy.router.host}:{deploy.router.port}"
    with tempfile.TemporaryDirectory(prefix="helixserve-launch-") as tmp:
        config_file = Path(tmp) / "deployment.yaml"
        deploy.to_yaml(config_file)
        children = start_processes(config_file, deploy, log_level)
        try:
            wait_ready(url, children, ready_timeout_s, lambda: bool(stop_signals), deploy.launch.ready_probe_timeout_s)
            print(f"helixserve is ready at {url} (model {deploy.model.name!r})", flush=True)
            print(f"try:\n  {curl_example(url, deploy)}", flush=True)
            print("Ctrl-C stops everything.", flush=True)
            while not stop_signals:
                why = supervise(children, deploy, config_file, log_level)
                if why is not None:
                    print(why, file=sys.stderr, flush=True)
                    return 1
                time.sleep(SUPERVISE_TICK_S)
            return 0
        except KeyboardInterrupt:
            return 0
        except RuntimeError as exc:
            print(f"helixserve launch: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            stop_processes(children, deploy.launch.stop_grace_s)
            print("stopped", flush=True)
