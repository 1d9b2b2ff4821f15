"""Practice 3: the router (and the protocol and config it uses) imports no torch, also when its
cache-aware policy loads the deployment's tokenizer and hashes a prompt's blocks."""

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


def test_the_router_tokenizes_and_hashes_prompts_without_torch():
    code = (
        "import sys\n"
        "from helixserve.models.tokenizer_loader import tokenizer_of\n"
        "from helixserve.protocol import CompletionRequest\n"
        "from helixserve.router.prompt_keys import PromptKeys\n"
        "keys = PromptKeys(tokenizer_of('kimi-k3-tiny', 'dummy'), 4)\n"
        "assert len(keys.block_keys(CompletionRequest(model='m', prompt='hello world'))) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
