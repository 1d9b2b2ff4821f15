"""`kernels.capture.no_collection`: what every CUDA graph capture runs under (CPU-checkable)."""

from __future__ import annotations

import gc

import pytest

from helixserve.kernels.capture import no_collection


class _Cycle:
    collected: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Cycle.collected.append(self.name)


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_garbage_made_before_is_collected_on_entry_and_nothing_during_the_block() -> None:
    _Cycle.collected.clear()
    _Cycle("before")  # unreachable only through its own cycle: only the collector frees it
    with no_collection():
        assert _Cycle.collected == ["before"]
        assert not gc.isenabled()
        for i in range(20_000):  # far past generation 0's threshold: an enabled collector would run
            _Cycle(f"during{i}")
        assert _Cycle.collected == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert len(_Cycle.collected) == 20_001


def test_the_collector_is_restored_after_an_exception_and_left_off_when_it_was_off() -> None:
    with pytest.raises(RuntimeError, match="capture failed"), no_collection():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    with no_collection():
        assert not gc.isenabled()
    assert not gc.isenabled()
