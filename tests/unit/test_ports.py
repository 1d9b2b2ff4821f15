"""Free ports come from below the kernel's ephemeral range (where no ``bind(0)`` or outgoing
connection of a neighbour takes them), are bindable, and are never handed out twice."""

from __future__ import annotations

import socket

from helixserve.parallel import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    got = ports.free_ports(8)
    assert len(set(got)) == 8
    if low is not None and low - ports._LOWEST >= 1000:
        assert all(ports._LOWEST <= p < low for p in got), (got, low)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_is_never_handed_out_twice_by_one_process():
    seen = set()
    for _ in range(50):
        p = ports.free_port()
        assert p not in seen
        seen.add(p)


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        draws = iter([taken, taken])
        real = ports._rng.randrange
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(draws, None) or real(a, b))
        monkeypatch.setattr(ports, "_given", set())
        got = ports.free_port()
        assert got != taken


def test_without_the_range_file_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)
    got = ports.free_ports(3)
    assert len(set(got)) == 3
