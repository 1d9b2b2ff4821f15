"""The e2e harness itself: stopping a deployment whose ctx already exited (a failed start) still
stops every other role (the dead one's ProcessLookupError does not leave the gen world and the
router running for the rest of the suite, holding cores and ports)."""

from __future__ import annotations

import subprocess
import sys

from helixserve.config import DeploymentConfig
from tests.e2e.conftest import Deployment


def test_stop_stops_every_role_when_one_already_exited() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait(30)
    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            for _ in range(2)]
    d = Deployment.__new__(Deployment)  # only its processes: no checkpoint needed
    d.procs = {"ctx": dead, "gen": live[0], "router": live[1]}
    try:
        d.stop()
        assert d.procs == {}
        assert all(proc.poll() is not None for proc in live)
    finally:
        for proc in live:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_section_overrides_merge_into_the_first_worker_and_keep_the_baseline(tmp_path) -> None:
    d = Deployment(tmp_path, tmp_path / "ckpt", baseline_gen=True, ctx={"pickup_timeout_s": 3.0},
                   gen={"cp": 1}, scheduler={"max_num_batched_tokens": 32})
    assert d.config.ctx[0].pickup_timeout_s == 3.0 and d.config.ctx[0].port > 0
    assert (d.config.gen[0].cp, d.config.gen[0].kv_source) == (1, "ucx")
    assert (d.config.gen[1].cp, d.config.gen[1].kv_source) == (1, "recompute")
    assert d.config.scheduler.max_num_batched_tokens == 32 and d.config.cache.tokens_per_block == 4
    assert DeploymentConfig.from_yaml(d.config_file) == d.config
