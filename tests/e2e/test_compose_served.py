"""deploy/compose.yaml served for real, on podman (deploy/ci/compose_podman.sh drives the engine).

The image is built from a debootstrap'd Debian base and a wheelhouse made with this host's pip
(no registry, no torch index here), compose brings ctx, gen and router up (the router only once
both workers' health checks pass: ``depends_on: condition: service_healthy``), and through the
router's published port the ``openai`` client gets the same greedy tokens as ``helixserve
launch`` on the same checkpoint (copied out of the image). Killing the ctx container answers 503
with OpenAI's error body until compose's restart policy has it back; ``down`` leaves no container,
network or volume of the project. The secrets come from env files: the internal secret (every
service; a worker refuses a caller without it) and the API-key file (the router only).

Runs as root with podman installable (CI: apt); skips, saying why, only where podman cannot be
installed. Select it with ``-k compose_served``. Times (base, build, up to ready) are printed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.e2e.conftest import MODEL, REPO, free_ports, wait_until

pytestmark = pytest.mark.slow

SCRIPT = REPO / "deploy" / "ci" / "compose_podman.sh"
PROMPTS = ["Hello, helix", "The quick brown fox jumps over"]
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 16
READY_TIMEOUT_S = 120
SECRET_HEADER = "X-Helixserve-Internal-Secret"
ERROR_KEYS = {"message", "type", "param", "code"}


def podman_unavailable() -> str | None:
    if shutil.which("podman") and shutil.which("docker-compose"):
        return None
    if os.geteuid() != 0:
        return "podman / docker-compose are not installed and this is not root: apt cannot install them"
    if not shutil.which("apt-get"):
        return "podman / docker-compose are not installed and there is no apt-get to install them"
    return None


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    secret: str
    api_key: str
    baseline: dict[str, tuple[str, int, str]]
    timings: dict[str, float] = field(default_factory=dict)
    down_done: bool = False

    def script(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run_script(self.env, *args, timeout=timeout, check=check)


def run_script(env: dict[str, str], *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                                timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"compose_podman.sh {' '.join(args)}: over {timeout} s\n{exc.stdout}\n{exc.stderr}")
    if check and result.returncode != 0:
        pytest.fail(f"compose_podman.sh {' '.join(args)} exited {result.returncode}\n"
                    f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def timings_of(output: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^timing: (\w+) (\d+) s$", output, re.MULTILINE)}


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def answers(url: str, api_key: str = "unused") -> dict[str, tuple[str, int, str]]:
    """{name: (text, completion tokens, finish reason)}: greedy completions, a chat and a stream."""
    api = client(url, api_key)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, seed=0)
        out[f"completion{i}"] = (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason)
    r = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, seed=0)
    out["chat"] = (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason)
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         seed=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    out["stream0"] = (text, chunks[-1].usage.completion_tokens, finish)
    return out


def is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def launch_baseline(tmp: Path, checkpoint: Path) -> dict[str, tuple[str, int, str]]:
    """`helixserve launch` of deploy/configs/local.yaml (the values of the compose config) on the
    image's checkpoint, on free ports; its answers, then stopped."""
    data = yaml.safe_load((REPO / "deploy" / "configs" / "local.yaml").read_text())
    router_port, ctx_port, gen_port, tx_port = free_ports(4)
    data["model"]["path"] = str(checkpoint)
    data["ctx"][0].update(port=ctx_port, transceiver_port=tx_port)
    data["gen"][0]["port"] = gen_port
    data["router"]["port"] = router_port
    config = tmp / "launch.yaml"
    config.write_text(yaml.safe_dump(data))
    log_path = tmp / "launch.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "helixserve.cli", "launch", "-c", str(config)],
                                    cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{router_port}"
    try:
        wait_until(lambda: launcher.poll() is not None or is_ready(url), READY_TIMEOUT_S,
                   "helixserve launch to be ready", interval=0.5)
        assert launcher.poll() is None, log_path.read_text()[-4000:]
        return answers(url)
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    reason = podman_unavailable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("compose")
    secret, api_key = secrets.token_urlsafe(32), f"ci-{secrets.token_hex(8)}"
    internal_env, api_env = tmp / "internal.env", tmp / "helixserve.env"
    internal_env.write_text(f"HELIXSERVE_INTERNAL_SECRET={secret}\n")
    api_env.write_text(f"HELIXSERVE_API_KEYS={api_key}\n")
    for path in (internal_env, api_env):
        path.chmod(0o600)
    (port,) = free_ports(1)
    # one state dir and project name per machine: a run killed outright is cleaned up by the next
    state = Path(os.environ.get("HELIX_CI_STATE", "/var/tmp/helixserve-ci"))
    env = {**os.environ, "HELIX_CI_STATE": str(state), "HELIX_PYTHON": sys.executable,
           "CONTAINERS_CONF": str(state / "containers.conf"),  # the script's engine settings
           "COMPOSE_PROJECT_NAME": "helixci", "HELIX_PORT": str(port),
           "HELIX_INTERNAL_ENV_FILE": str(internal_env), "HELIX_ENV_FILE": str(api_env)}
    started = time.monotonic()
    timings = timings_of(run_script(env, "prepare", timeout=900).stdout)
    checkpoint_dir = tmp / "checkpoint"
    run_script(env, "checkpoint", str(checkpoint_dir), timeout=120)
    url = f"http://127.0.0.1:{port}"
    stack = Stack(env=env, url=url, secret=secret, api_key=api_key, baseline={}, timings=timings)
    try:
        up_started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:  # compose brings the stack up while launch answers
            up = pool.submit(stack.script, "up", timeout=400)
            stack.baseline = launch_baseline(tmp, checkpoint_dir / "kimi-k3-tiny")
            stack.timings["launch_baseline"] = time.monotonic() - up_started
            stack.timings.update(timings_of(up.result().stdout))
        wait_until(lambda: is_ready(url), READY_TIMEOUT_S, f"the router's /ready at {url}", interval=0.5)
        stack.timings["up_to_ready"] = time.monotonic() - up_started
        yield stack
    finally:
        if not stack.down_done:
            print(f"compose logs: {save_logs(stack)}", file=sys.stderr)
            stack.script("down", timeout=200, check=False)
        stack.timings["whole_run"] = time.monotonic() - started
        line = "compose on podman: " + ", ".join(f"{k} {v:.0f} s" for k, v in stack.timings.items())
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\n{line}", flush=True)
        (tmp / "timings.json").write_text(json.dumps(stack.timings, indent=1))


PROBE_CTX = ("import socket, sys\n"
             "try:\n    print('ctx resolves to', sorted({a[4][0] for a in socket.getaddrinfo('ctx', 18100)}))\n"
             "    socket.create_connection(('ctx', 18100), 3).close(); print('ctx:18100 accepts a connection')\n"
             "except OSError as e:\n    print('ctx:18100:', repr(e))\n")


def diagnosis(stack: Stack) -> str:
    """What a failed request's reader needs: each service's restarts, the gen's view of the ctx's
    transceiver now, and the workers' last log lines (the whole logs: :func:`save_logs`)."""
    parts = [f"{s} restarts: {stack.script('restarts', s, check=False).stdout.strip()}" for s in ("ctx", "gen")]
    parts.append(stack.script("exec", "gen", "python3", "-c", PROBE_CTX, check=False).stdout.strip())
    for service in ("ctx", "gen"):
        logs = stack.script("compose", "logs", "--no-color", "--timestamps", "--tail", "40", service,
                            timeout=60, check=False)
        parts.append(f"--- {service} log tail ---\n{logs.stdout[-6000:]}")
    return "\n".join(parts)


def test_compose_serves_the_same_greedy_tokens_as_launch(stack: Stack) -> None:
    try:
        served = answers(stack.url, stack.api_key)  # the router takes the env file's API key
    except openai.APIError as error:
        kept = save_logs(stack, f"compose-failed-{time.time():.0f}.log")
        pytest.fail(f"{error}\n{diagnosis(stack)}\n(all logs: {kept})")
    assert set(served) == set(stack.baseline)
    for name, (text, tokens, finish) in served.items():
        assert tokens > 0 and text, f"{name}: empty answer {served[name]}"
        assert (text, tokens, finish) == stack.baseline[name], f"{name}: compose and launch differ"


def test_compose_health_gated_start_and_secrets_from_env_files(stack: Stack) -> None:
    def all_healthy() -> bool:
        ps = stack.script("compose", "ps").stdout
        return all(re.search(rf"_{service}_1 .* Up \(healthy\)", ps) for service in ("ctx", "gen", "router"))

    # the router's own check passes within a tick or two of its /ready (interval 5 s)
    wait_until(all_healthy, 60, "every service healthy in `compose ps`", interval=1,
               state=lambda: stack.script("compose", "ps").stdout)
    # the router was created only after both workers had passed a health check
    created = int(stack.script("created", "router").stdout) / 1e9
    checks = [line.split() for line in (Path(stack.env["HELIX_CI_STATE"]) / "health.log").read_text().splitlines()]
    for service in ("ctx", "gen"):
        passed = [float(t) for t, name, result in checks if name.endswith(f"_{service}_1") and result == "healthy"]
        assert passed and min(passed) < created, f"router created at {created}, {service} healthy at {passed[:1]}"
    router_env = stack.script("env", "router").stdout.splitlines()
    ctx_env = stack.script("env", "ctx").stdout.splitlines()
    secret_env = f"HELIXSERVE_INTERNAL_SECRET={stack.secret}"
    assert secret_env in router_env and secret_env in ctx_env and secret_env in stack.script("env", "gen").stdout
    assert f"HELIXSERVE_API_KEYS={stack.api_key}" in router_env
    assert not any(e.startswith("HELIXSERVE_API_KEYS") for e in ctx_env), "a worker got the router's API keys"
    # ... and the router enforces them
    with pytest.raises(openai.AuthenticationError):
        client(stack.url).models.list()
    assert [m.id for m in client(stack.url, stack.api_key).models.list().data] == [MODEL]
    # a worker answers only callers holding the internal secret (here: from inside the router's container)
    probe = ("import sys, urllib.request, urllib.error\n"
             "headers = dict(a.split('=', 1) for a in sys.argv[1:])\n"
             "req = urllib.request.Request('http://ctx:8100/v1/models', headers=headers)\n"
             "try:\n    print(urllib.request.urlopen(req, timeout=10).status)\n"
             "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    without = stack.script("exec", "router", "python3", "-c", probe).stdout.strip()
    wrong = stack.script("exec", "router", "python3", "-c", probe, f"{SECRET_HEADER}=not-{stack.secret}").stdout.strip()
    right = stack.script("exec", "router", "python3", "-c", probe, f"{SECRET_HEADER}={stack.secret}").stdout.strip()
    assert (without, wrong, right) == ("401", "401", "200")


def test_compose_ctx_killed_answers_503_then_restarts_and_serves_again(stack: Stack) -> None:
    restarts_before = int(stack.script("restarts", "ctx").stdout)
    pid = int(stack.script("pid", "ctx").stdout)
    os.kill(pid, signal.SIGKILL)  # the container's init: the whole ctx container dies, as in a crash
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0}
    seen: list[tuple[int, dict]] = []

    def answer() -> tuple[int, dict]:
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {stack.api_key}"})
        try:
            seen.append((r.status_code, r.json()))
        except ValueError:
            seen.append((r.status_code, {"not json": r.text}))
        return seen[-1]

    wait_until(lambda: answer()[0] == 503, 30, "the router's 503 for a dead ctx", interval=0.2)
    error = seen[-1][1]["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "service_unavailable_error", error
    assert "ctx" in error["message"] and error["code"], error
    wait_until(lambda: answer()[0] == 200, READY_TIMEOUT_S, "the router to serve again after ctx restarts",
               interval=0.5)
    assert {status for status, _ in seen} <= {200, 503}, seen
    assert int(stack.script("restarts", "ctx").stdout) == restarts_before + 1, "compose's restart policy"
    text = seen[-1][1]["choices"][0]["text"]
    assert (text, seen[-1][1]["usage"]["completion_tokens"]) == stack.baseline["completion0"][:2]
    assert answers(stack.url, stack.api_key) == stack.baseline


def save_logs(stack: Stack, name: str = "compose.log") -> Path:
    """Every container's log of the project (restarted ones' too) and the health checks', kept
    in the state dir under ``name``, for a failure's reader."""
    path = Path(stack.env["HELIX_CI_STATE"]) / name
    label = f"label=com.docker.compose.project={stack.env['COMPOSE_PROJECT_NAME']}"
    listed = subprocess.run(["podman", "ps", "-a", "--filter", label, "--format", "{{.ID}} {{.Names}}"],
                            env=stack.env, capture_output=True, text=True, timeout=60)
    parts = []
    for line in listed.stdout.splitlines():
        cid, names = line.split(maxsplit=1)
        logs = subprocess.run(["podman", "logs", "--timestamps", cid], env=stack.env, capture_output=True,
                              text=True, timeout=60)
        parts.append(f"=== {names} ({cid}) ===\n{logs.stdout}{logs.stderr}")
    health = Path(stack.env["HELIX_CI_STATE"]) / "health.log"
    parts.append(f"=== health checks ===\n{health.read_text() if health.exists() else ''}")
    path.write_text("\n".join(parts))
    return path


def test_compose_down_leaves_no_container_network_or_volume(stack: Stack) -> None:
    save_logs(stack)
    stack.down_done = True
    down = stack.script("down", timeout=200, check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    project = stack.env["COMPOSE_PROJECT_NAME"]
    label = f"label=com.docker.compose.project={project}"
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        listed = subprocess.run(["podman", *kind, "--filter", label, "--format", "{{.ID}}"], env=stack.env,
                                capture_output=True, text=True, timeout=60, check=True).stdout.split()
        assert not listed, f"podman {' '.join(kind)}: {listed} left of {project}"
    networks = subprocess.run(["podman", "network", "ls", "--format", "{{.Name}}"], env=stack.env,
                              capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert f"{project}_default" not in networks
    assert not is_ready(stack.url)
