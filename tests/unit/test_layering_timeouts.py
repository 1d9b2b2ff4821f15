"""Every timeout default defined once (config resolves every timeout default once). A wait a deployment may tune, or that bounds a failure, is a validated field of the config
modules, passed down to its user; an internal tick stays a named module constant, one definition
per value, on the reasoned allow-list below. The scan fails on any other literal."""

from __future__ import annotations

import ast
import asyncio
import math
import re
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "helixserve"
CONFIG_MODULES = {"helixserve/config.py", "helixserve/config_env.py", "helixserve/config_lifecycle.py",
                  "helixserve/config_http.py", "helixserve/config_transceiver.py", "helixserve/config_workers.py"}
WAIT_NAME = re.compile(r"timeout|grace|deadline|heartbeat|interval", re.IGNORECASE)
DURATION_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*_(S|MS|NS)$")  # module constants holding a duration

# (module, name) -> why it is an internal constant, not a deployment's setting. Module-level
# constants (UPPER_CASE) are ticks and shutdown-only waits; lower-case names are parameters.
INTERNAL = {
    ("helixserve/transceiver/polling.py", "DEFAULT_TICK_S"):
        "a poller's longest wait between sweeps; a completion's wakeup ends it earlier",
    ("helixserve/transceiver/ctx/sender.py", "ACTIVE_TICK_S"): "sender-thread tick while messages are in flight",
    ("helixserve/transceiver/ctx/sender.py", "IDLE_TICK_S"): "sender-thread tick while idle",
    ("helixserve/transceiver/ctx/sender.py", "STOP_JOIN_S"): "shutdown only: joining the sender thread",
    ("helixserve/transceiver/ctx/control_server.py", "SERVER_STOP_GRACE_S"):
        "shutdown only; every gRPC call is bounded by its own deadline (rpc_timeout_ms)",
    ("helixserve/transceiver/gen/control_client.py", "CHANNEL_CLOSE_DELAY_S"):
        "a closed client's channel is closed once grpc's connectivity thread (0.2 s wakeups) ended; no one waits",
    ("helixserve/transceiver/gen/control_client.py", "SHARD_DEADLINE_MARGIN_S"):
        "a margin under the configured transfer deadline, not a wait of its own",
    ("helixserve/serving/warm_up.py", "SETTLE_S"):
        "how long an overlapped engine may take to free the warm-up's cache (warm_up_timeout_s bounds the whole)",
    ("helixserve/serving/warm_up.py", "SETTLE_TICK_S"): "how often the settling engine's stats are asked",
    ("helixserve/transceiver/gen/pull.py", "WAIT_TICK_S"):
        "how often a bounded wait for a launched copy polls its event (drain_timeout_ms bounds it)",
    ("helixserve/transceiver/gen/receiver.py", "RETRACT_WAIT_S"):
        "a local 0-byte retraction after drain_timeout_ms already ran out; bounds a broken plane",
    ("helixserve/clock.py", "SPIN_BELOW_S"):
        "the length under which the real clock spins a wait instead of sleeping it (no wait of its own)",
    ("helixserve/transceiver/gen/receiver.py", "PULL_TICK_S"):
        "how often a poll probes in-flight device copies between sweeps; the poll's own interval bounds the wait",
    ("helixserve/transceiver/gen/receiver.py", "PREFETCH_RETRY_S"):
        "the interval between DescribePools asks at a gen rank's start (no one waits on it; a request "
        "that comes first asks with RequestShard)",
    ("helixserve/transceiver/ucxx_backend/plane.py", "PROGRESS_EPOLL_TIMEOUT_MS"): "one UCX progress wait",
    ("helixserve/transceiver/ucxx_backend/plane.py", "NOTIFIER_STOP_S"): "shutdown only: the notifier thread",
    ("helixserve/transceiver/ucxx_backend/plane.py", "NOTIFIER_PERIOD_NS"): "the notifier's close check",
    ("helixserve/engine/engine_thread.py", "INBOX_TICK_S"): "idle engine thread; a command wakes it at once",
    ("helixserve/log_throttle.py", "THROTTLE_INTERVAL_S"):
        "how often a throttled warning may repeat; no one waits on it",
    ("helixserve/engine/async_engine.py", "DRAIN_TICK_S"): "how often a shutdown re-checks live requests",
    ("helixserve/engine/async_engine.py", "THREAD_JOIN_S"): "shutdown only: the step in progress ends",
    ("helixserve/ctx_server/ctx_requests.py", "EXPIRY_TICK_S"): "ctx[].pickup_timeout_s (the hold deadline) is the bound; this is its sweep",
    ("helixserve/ctx_server/transfer.py", "STATS_INTERVAL_S"): "staleness of a /metrics gauge, no wait",
    ("helixserve/ctx_server/world_transfer.py", "HOLD_AGREE_S"): "ctx[].pickup_timeout_s bounds every rank's hold; this is how often the ranks agree on the freed ones",
    ("helixserve/serving/world_supervisor.py", "DEAD_RANK_WAIT_S"):
        "only to name a dead rank in a failure already detected; nothing hangs on it",
    ("helixserve/serving/world_supervisor.py", "DEAD_RANK_TICK_S"): "its poll tick",
    ("helixserve/launch/local.py", "SUPERVISE_TICK_S"): "the launcher's poll of children and /ready",
    ("helixserve/launch/slurm.py", "SUPERVISE_TICK_S"): "the SLURM job's poll of its steps and /ready",
    ("helixserve/launch/processes.py", "RESULT_TICK_S"): "the parent's poll of its ranks' results",
    ("helixserve/launch/processes.py", "LATE_RESULT_WAIT_S"): "a finished rank's queued result arriving",
    ("helixserve/launch/processes.py", "JOIN_S"): "joining ranks that already reported",
    ("helixserve/launch/processes.py", "JOIN_FAILED_S"): "the same after a failure (then killed)",
    # test harness helpers (polling a server under test), not serving code
    ("helixserve/testing/servers.py", "timeout"): "test harness: one HTTP call of a test",
    ("helixserve/testing/servers.py", "interval"): "test harness: wait_until's poll tick",
}


UNIT_FACTORS = {1e3, 1e6, 1e9}  # s <-> ms / us / ns, as a factor of a product or quotient


def _literals(node: ast.AST) -> list[float]:
    """Non-zero int/float literals anywhere in ``node`` (0 means "do not wait": a mode, no bound),
    except a unit conversion (``x * 1e3``, ``y / 1000``)."""
    factors = {id(side) for n in ast.walk(node) if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div))
               for side in (n.left, n.right) if isinstance(side, ast.Constant) and side.value in UNIT_FACTORS}
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) in (int, float)
            and n.value != 0 and id(n) not in factors]


def literal_waits(source: str, path: str) -> list[tuple[str, int, str]]:
    """``(name, line, what)`` for every numeric literal given to a wait outside the config: a
    parameter default, a class field, a keyword argument named like a wait, or a module-level
    duration constant."""
    tree = ast.parse(source, path)
    found = []
    for stmt in tree.body:  # module constants: UPPER_CASE = <number>
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and stmt.value is not None and _literals(stmt.value) \
                    and isinstance(stmt.value, (ast.Constant, ast.UnaryOp, ast.BinOp)) \
                    and (DURATION_CONSTANT.match(target.id) or (target.id.isupper() and WAIT_NAME.search(target.id))):
                found.append((target.id, stmt.lineno, f"module constant = {ast.unparse(stmt.value)}"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(a.arg, d.lineno, f"default of {node.name}({a.arg}=...) = {ast.unparse(d)}")
                      for a, d in pairs if WAIT_NAME.search(a.arg) and _literals(d)]
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None \
                        and WAIT_NAME.search(stmt.target.id) and _literals(stmt.value):
                    found.append((stmt.target.id, stmt.lineno, f"field {node.name}.{stmt.target.id} = "
                                                               f"{ast.unparse(stmt.value)}"))
        elif isinstance(node, ast.Call):
            found += [(k.arg, node.lineno, f"{ast.unparse(node.func)}({k.arg}={ast.unparse(k.value)})")
                      for k in node.keywords if k.arg and WAIT_NAME.search(k.arg) and _literals(k.value)]
    return found


def _scan() -> list[tuple[str, str, int, str]]:
    return [(path, name, line, what) for p in sorted(PKG.rglob("*.py"))
            if (path := p.relative_to(ROOT).as_posix()) not in CONFIG_MODULES
            for name, line, what in literal_waits(p.read_text(), path)]


def test_no_wait_default_outside_the_config() -> None:
    stray = [f"{path}:{line}: {what}" for path, name, line, what in _scan() if (path, name) not in INTERNAL]
    assert not stray, ("wait defaults written as literals outside the config modules (make them a validated "
                       "config field passed down, or a named internal constant on INTERNAL with its reason):\n"
                       + "\n".join(stray))


def test_internal_allow_list_is_still_needed() -> None:
    found = {(path, name) for path, name, _, _ in _scan()}
    stale = sorted(set(INTERNAL) - found)
    assert not stale, f"drop {stale} from INTERNAL"


def test_the_scan_finds_what_it_must() -> None:
    """The scanner itself: each kind of literal wait is found, a named or zero one is not."""
    source = ("RETRY_S = 2.0\nTICK = 1\nLIMIT_S = OTHER_MS / 1000\n"
              "def f(timeout_s: float = 5.0, *, grace_s=min(1.0, X), interval_s=0.0, n=3): ...\n"
              "class C:\n    heartbeat_s: float = 2.0\n    deadline: float = Field(9, gt=0)\n    size: int = 4\n"
              "post(url, timeout=5.0)\nget(timeout=TICK_S)\nask(deadline_ms=int(t * 1e3))\n")
    names = [name for name, _, _ in literal_waits(source, "x.py")]
    assert names == ["RETRY_S", "timeout_s", "grace_s", "heartbeat_s", "deadline", "timeout"], names


# -------------------------------------------------------------------- the new fields validate

NEW_FIELDS = [  # (section in a DeploymentConfig document, field)
    (("gen", 0), "heartbeat_s"), (("gen", 0), "world_stop_grace_s"), (("gen", 0), "failed_world_grace_s"),
    (("gen", 0), "restart_join_timeout_s"), (("ctx", 0), "release_grace_s"), (("router",), "control_timeout_s"),
    (("launch", "slurm"), "scontrol_timeout_s"), (("shutdown",), "connections_grace_s"),
    (("shutdown",), "requests_grace_s"),
]


def _document(section: tuple, field: str, value: object) -> dict:
    doc: dict = {"model": {"path": "/m"}}
    node: dict = {field: value}
    for key in reversed(section):
        node = [node] if isinstance(key, int) else {key: node}
    doc.update(node if isinstance(node, dict) else {})
    return doc


@pytest.mark.parametrize("section,field", NEW_FIELDS)
def test_new_wait_fields_validate_and_load(section: tuple, field: str) -> None:
    from helixserve.config import DeploymentConfig

    def value_of(deploy: DeploymentConfig) -> float:
        node = deploy
        for key in section:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        return getattr(node, field)

    default = value_of(DeploymentConfig(model={"path": "/m"}))
    assert math.isfinite(default) and default > 0
    assert value_of(DeploymentConfig.model_validate(_document(section, field, 0.25))) == 0.25
    for bad in (0, -1.0):
        with pytest.raises(ValidationError, match=field):
            DeploymentConfig.model_validate(_document(section, field, bad))


@pytest.mark.parametrize("field", ["collective_timeout_s", "run_timeout_s", "stop_grace_s"])
def test_offline_world_waits_validate_and_default_the_world_options(field: str) -> None:
    from helixserve.config import WorldRunConfig
    from helixserve.engine.world_rank import WorldOptions

    with pytest.raises(ValidationError, match=field):
        WorldRunConfig(**{field: 0})
    option = {"collective_timeout_s": "timeout_s"}.get(field, field)
    assert getattr(WorldOptions(), option) == getattr(WorldRunConfig(), field)


def test_transceiver_fallbacks_are_the_config_defaults() -> None:
    from helixserve.config import DeploymentConfig
    from helixserve.transceiver.base import DEFAULT_SLICE_S, DEFAULT_TIMEOUT_S

    transceiver = DeploymentConfig(model={"path": "/m"}).transceiver
    assert (DEFAULT_TIMEOUT_S, DEFAULT_SLICE_S) == (transceiver.timeout_s, transceiver.slice_s)


# -------------------------------------------------------------------- and reach their users

def test_a_gen_workers_waits_reach_its_world(tiny_checkpoints) -> None:
    """A real world of one (gloo, rank 0 in this process): the configured heartbeat is the
    WorldDriver's, the stop grace the LocalWorld's, the join timeout the supervisor's."""
    from helixserve.config import CacheConfig, DeploymentConfig
    from helixserve.gen_server.world import start_gen_world
    from helixserve.serving.world_core import world_options

    deploy = DeploymentConfig.model_validate({
        "model": {"path": str(tiny_checkpoints["kimi-k3-tiny"])},
        "cache": CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=2).model_dump(),
        "gen": [{"dp": 1, "cp": 1, "kv_source": "recompute", "heartbeat_s": 0.37, "collective_timeout_s": 41,
                 "world_stop_grace_s": 3.5, "failed_world_grace_s": 0.75, "restart_join_timeout_s": 7}]})
    server = deploy.gen[0]
    options = world_options(deploy, server)
    assert (options.timeout_s, options.stop_grace_s) == (41.0, 3.5)
    world = start_gen_world(deploy, server, options, None)
    try:
        assert world.driver.heartbeat_s == 0.37
        assert world.driver.groups.timeout.total_seconds() == 41.0
        assert world.local is not None and world.local.stop_grace_s == 3.5
        assert world.supervisor.server.restart_join_timeout_s == 7.0
        assert world.supervisor.server.failed_world_grace_s == 0.75
    finally:
        world.close()


def test_the_router_control_timeout_bounds_a_release_to_a_stuck_worker() -> None:
    """A real router service in front of a stand-in worker whose /v1/release never answers: the
    router's release gives up after ``router.control_timeout_s`` (the worker stalls far longer)."""
    import uvicorn
    from fastapi import FastAPI

    from helixserve.config import RouterConfig
    from helixserve.router.app import RouterService
    from helixserve.router.pool import WorkerState
    from helixserve.testing.servers import free_ports

    stall = threading.Event()
    worker = FastAPI()

    @worker.post("/v1/release")
    async def release() -> dict:
        await asyncio.to_thread(stall.wait, 30)
        return {}

    port, = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(worker, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the stand-in worker did not start"
        time.sleep(0.02)

    async def main() -> None:
        service = RouterService(RouterConfig(control_timeout_s=0.3), (url,), (url,), "m")
        async with service.lifespan(FastAPI()):
            assert service.orchestrator is not None
            assert service.orchestrator.control_timeout_s == 0.3
            # bounded well below the old hard-coded 5 s: with it, this wait_for would fail
            await asyncio.wait_for(service.orchestrator.post_quietly(WorkerState(url, "ctx"), "/v1/release", "r"),
                                   timeout=3.0)

    try:
        asyncio.run(main())
    finally:
        stall.set()
        server.should_exit = True
        thread.join(10)


def test_the_scontrol_timeout_bounds_a_hanging_scontrol(tmp_path: Path, monkeypatch) -> None:
    """A stand-in ``scontrol`` that hangs (the fault): the call ends at the timeout it is given."""
    import subprocess

    from helixserve.config import DeploymentConfig
    from helixserve.launch.slurm import expand_nodelist

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    deploy = DeploymentConfig.model_validate({"model": {"path": "/m"}, "launch": {"slurm": {"scontrol_timeout_s": 0.2}}})
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        expand_nodelist("n[1-2]", deploy.launch.slurm.scontrol_timeout_s)
    assert caught.value.timeout == 0.2


def test_the_ctx_release_grace_delays_the_cancel() -> None:
    """``ctx[].release_grace_s`` is how long a router release waits before cancelling the hold."""
    from helixserve.config import CtxServerConfig, DeploymentConfig
    from helixserve.ctx_server.transfer import CtxTransceiver

    server = CtxServerConfig(release_grace_s=0.2)
    transceiver = CtxTransceiver(None, None, None, DeploymentConfig(model={"path": "/m"}).transceiver, server)
    cancelled: list[float] = []

    async def record(request_id: str, reason: str) -> bool:  # observes when the cancel comes
        cancelled.append(asyncio.get_running_loop().time())
        return False

    transceiver.cancel = record  # type: ignore[method-assign]

    async def main() -> float:
        start = asyncio.get_running_loop().time()
        transceiver.cancel_later("r", "released by the router")
        await asyncio.sleep(0.1)
        assert not cancelled  # not before the grace
        while not cancelled:
            await asyncio.sleep(0.01)
        return cancelled[0] - start

    assert asyncio.run(main()) >= 0.2
