"""STYLE rule 3: helixserve.protocol imports no torch (checked by grep and by a fresh import)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PROTOCOL_DIR = Path(__file__).resolve().parents[2] / "helixserve" / "protocol"
TORCH_IMPORT = re.compile(r"^\s*(import\s+torch\b|from\s+torch\b)", re.MULTILINE)


def test_protocol_sources_do_not_import_torch():
    sources = sorted(PROTOCOL_DIR.rglob("*.py"))
    assert sources, f"no sources under {PROTOCOL_DIR}"
    offenders = [str(p) for p in sources if TORCH_IMPORT.search(p.read_text())]
    assert offenders == []


def test_importing_protocol_does_not_load_torch():
    code = ("import sys, helixserve.protocol, helixserve.protocol.openai, "
            "helixserve.protocol.disagg, helixserve.protocol.errors; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PROTOCOL_DIR.parents[1])
    assert out.stdout.strip() == "[]", out.stdout
