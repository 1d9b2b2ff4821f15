"""The UCX transport is an install extra: its absence is named with what to install."""

from __future__ import annotations

import sys

import pytest


def test_a_missing_ucxx_is_named_with_the_extra_to_install(monkeypatch):
    from helixserve.transceiver.ucxx_backend.plane import UcxxMissingError, import_ucxx

    for name in [m for m in sys.modules if m == "ucxx" or m.startswith("ucxx.")] + ["ucxx"]:
        monkeypatch.setitem(sys.modules, name, None)  # "import ucxx" fails as if not installed
    with pytest.raises(UcxxMissingError, match=r"helixserve\[cu12\].*helixserve\[cu13\]"):
        import_ucxx()
