"""Workers warm up before ``/ready`` (serving/warm_up.py): real ctx and gen apps on the tiny K3
checkpoint served by uvicorn on loopback. A held-back engine step (a fault injecting delay) keeps
the warm-up running while the test looks: ``/health`` 200, ``/ready`` 503 "warming up",
completions refused; once it finishes ``/ready`` is 200 and nothing is left allocated. A failed
warm-up is a 503 naming the cause on both, and a ``serve-ctx`` whose warm-up fails exits 1."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="server deps not installed")
import uvicorn  # noqa: E402

from helixserve.config import CtxServerConfig, DeploymentConfig, GenServerConfig  # noqa: E402
from helixserve.serving.openai_serving import ServingLimits  # noqa: E402
from helixserve.serving.warm_up import BATCH, NUM_DECODE_STEPS, WarmUpState, warm_up_prompts  # noqa: E402
from helixserve.testing.servers import free_ports, http, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGE, CHUNK = 4, 16


def _deploy(model: Path, **cache: Any) -> DeploymentConfig:
    ctx_port, gen_port, tx_port, router_port = free_ports(4)
    return DeploymentConfig.model_validate({
        "model": {"path": str(model), "served_name": "m"},
        "cache": {"tokens_per_block": PAGE, "memory_budget_mib": 8, "max_num_seqs": 4, "max_model_len": 128,
                  **cache},
        "scheduler": {"max_num_batched_tokens": CHUNK},
        "ctx": [{"port": ctx_port, "transceiver_port": tx_port}],
        "gen": [{"port": gen_port, "dp": 1, "cp": 1, "kv_source": "recompute"}],
        "router": {"port": router_port},
        "security": {"allow_unauthenticated": True},
    })


def _limits(max_model_len: int, max_prompt_tokens: int | None = None) -> ServingLimits:
    return ServingLimits("m", max_model_len, 100, None, max_prompt_tokens or max_model_len, 1 << 20)


def warm_up_request(limits: ServingLimits, page: int, chunk: int):
    """The first warm-up step's (prompt, params) under `limits`, as the worker derives it."""
    return warm_up_prompts(limits.max_model_len, limits.max_prompt_tokens, limits.vocab_size, page, chunk)[0][:2]


def test_the_warm_up_prompt_crosses_a_page_and_the_chunk_budget_within_the_context():
    prompt, params = warm_up_request(_limits(128), PAGE, CHUNK)
    assert len(prompt) == CHUNK + 1 and all(0 <= t < 100 for t in prompt)
    assert params.is_greedy and params.ignore_eos and params.max_tokens == NUM_DECODE_STEPS + 1
    assert len(warm_up_request(_limits(128), 64, CHUNK)[0]) == 65  # a page larger than the chunk
    # the context bounds it: prompt + decode steps + 1 fit, at the limit and one past it
    fits = CHUNK + 1 + NUM_DECODE_STEPS + 1
    assert len(warm_up_request(_limits(fits), PAGE, CHUNK)[0]) == CHUNK + 1
    assert len(warm_up_request(_limits(fits - 1), PAGE, CHUNK)[0]) == CHUNK
    assert len(warm_up_request(_limits(128, max_prompt_tokens=9), PAGE, CHUNK)[0]) == 9
    assert len(warm_up_request(_limits(2), PAGE, CHUNK)[0]) == 1


def test_the_warm_up_also_runs_short_medium_and_whole_page_prompts():
    """Kernels specialize on length classes (fla's l2norm autotunes per 64k token-heads, Triton
    on integers equal to 1 or divisible by 16): after the long prompt the warm-up runs a page + 1,
    8 pages + 1 and 8 whole pages (alone, then BATCH at once), each clipped to the context, none
    twice."""
    steps = warm_up_prompts(4096, 4096, 100, PAGE, CHUNK)
    assert [(len(p), copies) for p, _, copies in steps] == [(CHUNK + 1, 1), (PAGE + 1, 1), (8 * PAGE + 1, 1),
                                                            (8 * PAGE, 1), (8 * PAGE, BATCH)]
    assert [len(p) for p, _, _ in warm_up_prompts(4096, 4096, 100, 64, 8192)] == [4096 - NUM_DECODE_STEPS - 1, 65,
                                                                                513, 512, 512]
    assert [(len(p), c) for p, _, c in warm_up_prompts(PAGE + 1 + NUM_DECODE_STEPS + 1, 1 << 20, 100, PAGE, CHUNK)
            ] == [(PAGE + 1, 1), (PAGE + 1, BATCH)]  # clipped: the batch step stays, at the clipped length
    assert [(len(p), c) for p, _, c in warm_up_prompts(128, 3, 100, PAGE, CHUNK)] == [(3, 1), (3, BATCH)]
    assert all(params.is_greedy and params.max_tokens == NUM_DECODE_STEPS + 1
               for _, params, _ in warm_up_prompts(4096, 4096, 100, PAGE, CHUNK))


@contextmanager
def _serving(app, port: int) -> Iterator[str]:  # noqa: ANN001 (a FastAPI app)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _status(f"{url}/health") is not None, 60, "the worker to answer")
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def _status(url: str) -> int | None:
    try:
        return http("GET", url, timeout=5)[0]
    except OSError:
        return None


def _hold_steps(app) -> tuple[threading.Event, list[int]]:  # noqa: ANN001
    """Every engine step waits for the returned event (injected delay); the list counts steps."""
    core = app.state.worker.engine._core  # noqa: SLF001 - the fault goes into the real core
    gate, steps = threading.Event(), []
    real_step = core.step

    def held_step():  # noqa: ANN202
        gate.wait(60)
        steps.append(1)
        return real_step()

    core.step = held_step
    return gate, steps


def _build(role: str, deploy: DeploymentConfig):  # noqa: ANN202
    if role == "ctx":
        from helixserve.ctx_server.app import build_ctx_app
        return build_ctx_app(deploy, deploy.ctx[0]), deploy.ctx[0].port
    from helixserve.gen_server.app import build_gen_app
    return build_gen_app(deploy, deploy.gen[0]), deploy.gen[0].port


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_ready_is_503_until_the_warm_up_ran_and_it_leaves_nothing_allocated(role, tiny_checkpoints):
    app, port = _build(role, _deploy(tiny_checkpoints["kimi-k3-tiny"]))
    gate, steps = _hold_steps(app)
    with _serving(app, port) as url:
        assert _status(f"{url}/health") == 200  # alive while warming up
        status, ready = http("GET", f"{url}/ready")
        assert status == 503 and ready["status"] == "warming up" and ready["warm_up"]["state"] == "warming up"
        status, refused = http("POST", f"{url}/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and refused["error"]["code"] == f"{role}_worker_warming_up"
        gate.set()
        wait_until(lambda: _status(f"{url}/ready") == 200, 60, "the warm-up to finish",
                   state=lambda: http("GET", f"{url}/ready"))
        stats = http("GET", f"{url}/stats")[1]
        assert stats["warm_up"]["state"] == "done" and stats["warm_up"]["num_prompt_tokens"] == 8 * PAGE + 1
        assert stats["warm_up"]["prompt_lengths"] == [CHUNK + 1, PAGE + 1, 8 * PAGE + 1, 8 * PAGE, 8 * PAGE]
        assert stats["num_used_blocks"] == stats["num_used_slots"] == stats["num_held"] == 0
        assert stats["num_running"] == stats["num_waiting"] == stats["num_live_requests"] == 0
        assert len(steps) >= 2 + NUM_DECODE_STEPS  # two prefill chunks, then the decode steps
        status, answer = http("POST", f"{url}/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_failed_warm_up_is_a_503_naming_it_and_stops_the_worker(tiny_checkpoints):
    app, port = _build("gen", _deploy(tiny_checkpoints["kimi-k3-tiny"]))
    worker = app.state.worker
    stopped = threading.Event()
    worker.warm_up.on_failure = stopped.set  # instead of SIGTERM to this test process
    core = worker.engine._core.core  # noqa: SLF001 - the driver's engine

    def broken_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("injected kernel failure")

    core.runner.run = broken_forward
    with _serving(app, port) as url:
        wait_until(stopped.is_set, 60, "the warm-up to fail")
        assert worker.warm_up.state is WarmUpState.FAILED and worker.exit_code == 1
        for path in ("/health", "/ready"):
            status, body = http("GET", f"{url}{path}")
            assert status == 503 and "its warm-up failed" in body["status"], body
            assert "injected kernel failure" in body["status"]
        assert body["num_used_blocks"] == body["num_used_slots"] == 0


def test_a_warm_up_past_its_bound_fails_and_frees_its_request(tiny_checkpoints):
    app, port = _build("gen", _deploy(tiny_checkpoints["kimi-k3-tiny"]))
    worker = app.state.worker
    stopped = threading.Event()
    worker.warm_up.on_failure, worker.warm_up.timeout_s = stopped.set, 0.5
    gate, _ = _hold_steps(app)  # never opened before the bound
    with _serving(app, port) as url:
        wait_until(stopped.is_set, 30, "the warm-up to time out")
        gate.set()
        status, body = http("GET", f"{url}/ready")
        assert status == 503 and body["status"] == "its warm-up failed: it took over 0.5 s", body
        wait_until(lambda: http("GET", f"{url}/stats")[1]["num_used_blocks"] == 0, 10, "the request freed")
        assert http("GET", f"{url}/stats")[1]["num_live_requests"] == 0


def test_warm_up_off_is_ready_at_once(tiny_checkpoints):
    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"])
    deploy = deploy.model_copy(update={"gen": [deploy.gen[0].model_copy(update={"warm_up": False})]})
    app, port = _build("gen", deploy)
    gate, steps = _hold_steps(app)
    with _serving(app, port) as url:
        status, ready = http("GET", f"{url}/ready")
        assert status == 200 and ready["warm_up"]["state"] == "off" and not steps
    gate.set()


# the real command, its model runner's forward failing (a kernel that cannot run on this device)
_BROKEN_SERVE_CTX = """
import sys
from helixserve.cli import main
from helixserve.engine.runner import ModelRunner

def broken_run(self, *args, **kwargs):
    raise RuntimeError("injected kernel failure")

ModelRunner.run = broken_run
sys.exit(main(sys.argv[1:]))
"""


def test_a_ctx_worker_whose_warm_up_fails_exits_1_naming_the_cause(tmp_path, tiny_checkpoints):
    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"])
    config = tmp_path / "deployment.yaml"
    deploy.to_yaml(config)
    proc = subprocess.run([sys.executable, "-c", _BROKEN_SERVE_CTX, "serve-ctx", "-c", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("helixserve serve-ctx: the worker stopped: its warm-up failed"), proc.stderr[-2000:]
    assert "injected kernel failure" in last
