"""The launchers' readiness probe: a server's ``/ready`` answering 200 (both launchers poll it)."""

from __future__ import annotations

import urllib.error
import urllib.request


def is_ready(url: str, probe_timeout_s: float) -> bool:
    """``GET {url}/ready`` answered 200 within ``probe_timeout_s`` (anything else: not ready)."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=probe_timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
