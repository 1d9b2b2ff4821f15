"""The forkserver that local world ranks come from ignores SIGTERM: a SIGTERM to the process group
(``helixserve launch``'s stop) leaves it running, so a rank forked from it still reads as alive
(a killed forkserver makes every rank read as exited with code 255)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import REPO

# a gen worker in miniature: it handles SIGTERM itself, its rank (here a sleep) ignores it
_SCRIPT = """
import json, multiprocessing as mp, os, signal, time
from helixserve.parallel.forkserver import start_forkserver
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
start_forkserver()
rank = mp.get_context("forkserver").Process(target=time.sleep, args=(60,), daemon=True)
rank.start()
os.killpg(os.getpgrp(), signal.SIGTERM)
time.sleep(1.0)
alive, code = rank.is_alive(), rank.exitcode
rank.kill()
rank.join(10)
print(json.dumps({"terms": len(terms), "alive": alive, "code": code, "killed": rank.exitcode}))
"""


def test_a_sigterm_to_the_group_leaves_the_forkserver_and_its_ranks_alone():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"terms": 1, "alive": True, "code": None, "killed": -9}, (result, done.stderr)
