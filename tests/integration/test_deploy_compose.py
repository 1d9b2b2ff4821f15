"""deploy/compose.yaml: valid for Debian's docker-compose, and the same processes and config as
``helixserve launch`` (and the SLURM launcher) start: one service per ctx worker and gen world
plus the router, each running the launcher's subcommand on the shared config file, whose values
equal the launcher's apart from where the servers listen."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helixserve.config import DeploymentConfig
from helixserve.launch.slurm import role_args

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose.yaml"
MOUNTED_CONFIG = "/etc/helixserve/config.yaml"
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
INTERNAL_ENV, API_KEYS_ENV = "internal.env.example", "helixserve.env.example"


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # merge keys (<<) resolve here


def service_sets() -> dict[str, dict[str, dict]]:
    """{"default" | profile: {service: spec}}: the services one `compose up` starts together."""
    sets: dict[str, dict[str, dict]] = {}
    for name, spec in compose_services().items():
        for profile in spec.get("profiles") or ["default"]:
            sets.setdefault(profile, {})[name] = spec
    return sets


def role_of(spec: dict) -> str:
    return spec["command"][0]


def default_path(value: str) -> Path:
    """``${VAR:-./x}`` or ``./x`` -> the path, relative to the compose file's directory."""
    match = re.fullmatch(r"\$\{\w+:-([^}]*)\}|([^$]*)", value)
    assert match, f"cannot read a default path from {value!r}"
    return (COMPOSE.parent / (match.group(1) or match.group(2))).resolve()


def shared_config_file(spec: dict) -> Path:
    for volume in spec["volumes"]:
        source, target = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::ro)?", volume).groups()
        if target == MOUNTED_CONFIG:
            return default_path(source)
    raise AssertionError(f"{spec['command']}: no volume mounts the shared config at {MOUNTED_CONFIG}")


def launcher_args(deploy: DeploymentConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The arguments `helixserve launch` gives each process (captured, not started)."""
    from helixserve.launch import local as launch

    started: list[list[str]] = []

    class FakePopen:
        def __init__(self, argv: list[str], **_: object) -> None:
            started.append(list(argv))

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    config_file = tmp_path / "deployment.yaml"
    launch.start_processes(config_file, deploy, "WARNING")
    out = []
    for argv in started:
        assert argv[:3] == [sys.executable, "-m", "helixserve.cli"], argv
        args = argv[3:]
        if args[0] == "--log-level":
            args = args[2:]
        i = args.index("-c")
        assert args[i + 1] == str(config_file)
        out.append(args[:i] + args[i + 2:])
    return sorted(out)


def without_network(deploy: DeploymentConfig) -> dict:
    """The config minus where servers listen / are reached, where the checkpoint lives and which
    GPU index each worker names (a container sees only its own GPUs)."""
    data = deploy.model_dump(mode="json")
    data["model"].pop("path")
    for worker in (*data["ctx"], *data["gen"]):
        worker.pop("host")
        worker.pop("transceiver_host", None)
        if (worker["device"] or data["model"]["device"]).startswith("cuda"):
            worker["device"] = "cuda"
    for key in ("host", "ctx_urls", "gen_urls"):
        data["router"].pop(key)
    return data


def test_compose_file_is_valid_for_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (CI installs it: deploy/ci/install_system_deps.sh)")
    result = subprocess.run([binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                            timeout=60, cwd=COMPOSE.parent)
    assert result.returncode == 0, result.stderr
    profiles = subprocess.run([binary, "-f", str(COMPOSE), "--profile", "gpu", "config", "--services"],
                              capture_output=True, text=True, timeout=60, cwd=COMPOSE.parent)
    assert profiles.returncode == 0, profiles.stderr
    assert set(profiles.stdout.split()) == set(compose_services())


# ids avoid the word "gpu": conftest skips tests with that keyword when CUDA is missing
@pytest.mark.parametrize("profile", ["default", "gpu"], ids=["default_profile", "cuda_profile"])
def test_compose_runs_the_launchers_processes_on_one_shared_config(
        profile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    services = service_sets()[profile]
    config_files = {shared_config_file(spec) for spec in services.values()}
    assert len(config_files) == 1, f"{profile}: services mount different config files {config_files}"
    deploy = DeploymentConfig.from_yaml(config_files.pop())

    compose_args = []
    for name, spec in services.items():
        command = list(spec["command"])
        i = command.index("-c")
        assert command[i + 1] == MOUNTED_CONFIG, f"{name} reads {command[i + 1]}, not the shared config"
        compose_args.append(command[:i] + command[i + 2:])
    assert sorted(compose_args) == launcher_args(deploy, tmp_path, monkeypatch)
    assert sorted(compose_args) == sorted(args for _, args in role_args(deploy))

    by_role = {role_of(spec): name for name, spec in services.items()}
    # workers are reached by service name on their configured ports
    assert deploy.ctx_urls == tuple(f"http://{by_role['serve-ctx']}:{w.port}" for w in deploy.ctx)
    assert deploy.gen_urls == tuple(f"http://{by_role['serve-gen']}:{w.port}" for w in deploy.gen)
    assert all(w.transceiver_host == by_role["serve-ctx"] for w in deploy.ctx)


@pytest.mark.parametrize("profile, launcher_config", [("default", "local.yaml"), ("gpu", "gpu2.yaml")],
                         ids=["default_profile", "cuda_profile"])
def test_compose_config_equals_the_launchers_config_but_for_the_network(profile: str, launcher_config: str) -> None:
    services = service_sets()[profile]
    deploy = DeploymentConfig.from_yaml(shared_config_file(next(iter(services.values()))))
    launched = DeploymentConfig.from_yaml(REPO / "deploy" / "configs" / launcher_config)
    assert without_network(deploy) == without_network(launched)
    assert deploy.model.path.name == launched.model.path.name
    assert {w.host for w in (*deploy.ctx, *deploy.gen)} | {deploy.router.host} == {"0.0.0.0"}


def test_compose_one_device_config_equals_gpu1_but_for_the_network() -> None:
    """docker/config.gpu1.yaml, the `gpu` profile on one GPU (HELIX_GPU_CONFIG), is configs/gpu1.yaml."""
    deploy = DeploymentConfig.from_yaml(COMPOSE.parent / "docker" / "config.gpu1.yaml")
    launched = DeploymentConfig.from_yaml(REPO / "deploy" / "configs" / "gpu1.yaml")
    assert without_network(deploy) == without_network(launched)
    assert {w.host for w in (*deploy.ctx, *deploy.gen)} | {deploy.router.host} == {"0.0.0.0"}
    gpu_services = service_sets()["gpu"]
    mounted = next(v for v in gpu_services["ctx-gpu"]["volumes"] if v.endswith(f":{MOUNTED_CONFIG}:ro"))
    assert mounted.startswith("${HELIX_GPU_CONFIG:-"), "the gpu profile's config cannot be chosen"
    assert deploy.ctx_urls == ("http://ctx-gpu:8100",) and deploy.gen_urls == ("http://gen-gpu:8200",)
    assert all(w.transceiver_host == "ctx-gpu" for w in deploy.ctx)


CTX_WORLD_CONFIG = "./docker/config.ctx-world.yaml"  # HELIX_CONFIG's value for a ctx world


def test_compose_ctx_world_runs_its_ranks_in_the_ctx_container_on_the_launchers_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docker/config.ctx-world.yaml (HELIX_CONFIG) is configs/ctx-world.yaml but for the network:
    a ctx world of tp 2 whose ranks all run in the one `ctx` container (its service runs the one
    ``serve-ctx`` process launch starts, which spawns rank 1), beside a gen world that pulls each
    ctx rank's shard over UCX (every rank's KV sender in that container, on transceiver_port + rank)."""
    deploy = DeploymentConfig.from_yaml(COMPOSE.parent / CTX_WORLD_CONFIG)
    launched = DeploymentConfig.from_yaml(REPO / "deploy" / "configs" / "ctx-world.yaml")
    assert without_network(deploy) == without_network(launched)
    assert (deploy.ctx[0].tp, deploy.ctx[0].ep) == (2, 2) and len(deploy.ctx) == 1
    assert all(g.kv_source == "ucx" for g in (*deploy.gen, *launched.gen))
    assert deploy.ctx_transceivers == {("ctx", 18100), ("ctx", 18101)}
    assert {w.host for w in (*deploy.ctx, *deploy.gen)} | {deploy.router.host} == {"0.0.0.0"}
    services = service_sets()["default"]
    mounted = next(v for v in services["ctx"]["volumes"] if v.endswith(f":{MOUNTED_CONFIG}:ro"))
    assert mounted.startswith("${HELIX_CONFIG:-"), "the default profile's config cannot be chosen"
    compose_args = sorted(spec["command"][:spec["command"].index("-c")] for spec in services.values())
    assert compose_args == launcher_args(deploy, tmp_path, monkeypatch)
    assert deploy.ctx_urls == ("http://ctx:8100",) and deploy.ctx[0].transceiver_host == "ctx"


def test_compose_file_with_the_ctx_world_config_is_valid_for_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (CI installs it: deploy/ci/install_system_deps.sh)")
    result = subprocess.run([binary, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                            cwd=COMPOSE.parent, env={**os.environ, "HELIX_CONFIG": CTX_WORLD_CONFIG})
    assert result.returncode == 0, result.stderr
    mounted = (COMPOSE.parent / CTX_WORLD_CONFIG).resolve()
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("ctx", "gen", "router"):
        volumes = services[name]["volumes"]  # docker-compose v1: "src:dst:ro"; v2: mappings
        pairs = [tuple(v.split(":")[:2]) if isinstance(v, str) else (v["source"], v["target"]) for v in volumes]
        assert (str(mounted), MOUNTED_CONFIG) in pairs, (name, volumes)


@pytest.mark.parametrize("config, devices", [
    ("configs/gpu1.yaml", ("cuda:0", "cuda:0")), ("configs/gpu2.yaml", ("cuda:0", "cuda:1")),
    ("docker/config.gpu.yaml", ("cuda:0", "cuda:0")), ("docker/config.gpu1.yaml", ("cuda:0", "cuda:0"))],
    ids=["one_device", "two_devices", "compose_two_devices", "compose_one_device"])
def test_cuda_configs_move_the_kv_over_ucx_to_a_gen_world_and_warm_up(config: str, devices: tuple[str, str]) -> None:
    deploy = DeploymentConfig.from_yaml(REPO / "deploy" / config)
    assert deploy.model.device.startswith("cuda") and deploy.cache.tokens_per_block == 64
    assert (deploy.ctx[0].device, deploy.gen[0].device) == devices
    for gen in deploy.gen:
        assert gen.kv_source == "ucx" and gen.runs_world and gen.world_size == 1  # one GPU per world
    assert all(w.warm_up for w in (*deploy.ctx, *deploy.gen))
    if config.startswith("configs/"):  # ctx and gen on one host: loopback
        assert {w.host for w in (*deploy.ctx, *deploy.gen)} == {"127.0.0.1"}


def test_compose_cuda_profile_shares_the_hosts_ipc_namespace() -> None:
    """UCX's cuda_ipc between the ctx and gen containers needs one IPC namespace."""
    for name, spec in service_sets()["gpu"].items():
        assert spec.get("ipc") == "host", f"{name} has its own IPC namespace"


def test_compose_default_config_matches_launchs_built_in_default() -> None:
    from helixserve.launch.local import default_deployment

    deploy = DeploymentConfig.from_yaml(shared_config_file(service_sets()["default"]["router"]))
    default = without_network(default_deployment())
    assert {k: v for k, v in without_network(deploy).items() if k != "model"} == \
        {k: v for k, v in default.items() if k != "model"}
    assert deploy.model.device == "cpu" and deploy.model.name == default_deployment().model.name


# ids avoid the word "gpu": conftest skips tests with that keyword when CUDA is missing
@pytest.mark.parametrize("profile", ["default", "gpu"], ids=["default_profile", "cuda_profile"])
def test_compose_health_ports_secrets_and_devices(profile: str) -> None:
    services = service_sets()[profile]
    deploy = DeploymentConfig.from_yaml(shared_config_file(next(iter(services.values()))))
    ports = {"serve-ctx": deploy.ctx[0].port, "serve-gen": deploy.gen[0].port, "router": deploy.router.port}
    for name, spec in services.items():
        role = role_of(spec)
        test = spec["healthcheck"]["test"]
        # a worker is healthy once ready: loaded and warmed up (its /health is liveness only)
        assert test[-1] == f"http://127.0.0.1:{ports[role]}/ready", f"{name} checks {test[-1]}"
        if role == "router":
            assert spec["ports"] == [f"${{HELIX_PORT:-8000}}:{deploy.router.port}"]
            workers = {n for n, s in services.items() if role_of(s) != "router"}
            assert spec["depends_on"] == {n: {"condition": "service_healthy"} for n in workers}
            assert [default_path(f).name for f in spec["env_file"]] == [INTERNAL_ENV, API_KEYS_ENV]
        else:
            assert "ports" not in spec, f"{name} publishes a port; only the router may"
            assert [default_path(f).name for f in spec["env_file"]] == [INTERNAL_ENV], \
                f"{name} gets the router's API keys or no internal secret"
        for env_file in spec["env_file"]:
            assert default_path(env_file).is_file(), f"{name}: env_file {env_file} does not exist"
        devices = spec.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if profile == "gpu" and role != "router":
            assert devices and devices[0]["capabilities"] == ["gpu"], f"{name} reserves no GPU"
        else:
            assert not devices


def test_healthcheck_script_reports_up_and_down(tmp_path: Path) -> None:
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        up = subprocess.run([sys.executable, str(HEALTHCHECK), url], capture_output=True, timeout=30)
        missing = subprocess.run([sys.executable, str(HEALTHCHECK), url + "no-such-file"], capture_output=True,
                                 timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    down = subprocess.run([sys.executable, str(HEALTHCHECK), url], capture_output=True, timeout=30)
    assert (up.returncode, missing.returncode, down.returncode) == (0, 1, 1)
