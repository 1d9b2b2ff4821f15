"""Practice 3: the router (and the protocol and config it uses) imports no torch."""

import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="server deps (fastapi, uvicorn, aiohttp, prometheus-client) not installed")


def test_router_imports_without_torch():
    code = (
        "import sys, helixserve.router.app, helixserve.router.proxy, helixserve.serving.http;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
