"""Practice 3: scheduling and cache bookkeeping import no torch."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "helixserve"
TORCH_FREE = [
    "kvcache/__init__.py",
    "kvcache/errors.py",
    "kvcache/allocator.py",
    "kvcache/helix.py",
    "kvcache/manager.py",
    "kvcache/prefix_events.py",
    "kvcache/prefix_index.py",
    "kvcache/prefix_manager.py",
    "kvcache/state_checkpoints.py",
    "engine/admission.py",
    "engine/cache_release.py",
    "engine/lookahead.py",
    "engine/preemption.py",
    "engine/prefix_steps.py",
    "engine/request.py",
    "engine/scheduler.py",
    "engine/scheduler_output.py",
    "engine/step_rows.py",
    "engine/stop.py",
]
_IMPORT_TORCH = re.compile(r"^\s*(import\s+torch\b|from\s+torch\b)", re.MULTILINE)


@pytest.mark.parametrize("rel", TORCH_FREE)
def test_source_does_not_import_torch(rel):
    assert not _IMPORT_TORCH.search((ROOT / rel).read_text()), f"{rel} imports torch"


def test_kvcache_bookkeeping_imports_without_torch():
    code = (
        "import sys, helixserve.kvcache, helixserve.kvcache.manager, helixserve.kvcache.prefix_manager;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
