"""Free ports come from below the kernel's ephemeral range (where no ``bind(0)`` or outgoing
connection of a neighbour takes them), are bindable, and are never handed out twice."""

from __future__ import annotations

import socket

import pytest

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


def test_a_reserved_port_is_never_drawn(monkeypatch):
    """A launcher's child never draws a port of the deployment (the gen worker's, say) for its
    own rendezvous before that worker binds it: the CI failure this mends."""
    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._LOWEST + 1000)
    reserved = set(range(ports._LOWEST, ports._LOWEST + 990))  # leaves ten ports to draw from
    got = ports.free_ports(5, reserved=reserved)
    assert len(set(got)) == 5 and not set(got) & reserved, got


def test_the_reservation_travels_from_the_launcher_to_the_draw(monkeypatch):
    """child_environment names every port of the deployment (and keeps its parent's); the
    child's config.reserved_ports() reads them back: the path local_world and processes use."""
    from helixserve import config

    monkeypatch.setenv(config.RESERVED_PORTS_ENV, "31000")
    deploy = config.DeploymentConfig(model={"path": "/unused"},
                                     ctx=[{"port": 21001, "transceiver_port": 21002}], gen=[{"port": 21003}],
                                     router={"port": 21004})
    env = config.child_environment(deploy)
    monkeypatch.setattr(config.os, "environ", env)
    assert config.reserved_ports() == {21001, 21002, 21003, 21004, 31000}


def test_with_every_low_port_reserved_the_kernel_chooses_one_outside_the_reservation(monkeypatch):
    """Capacity exhausted: no port below the ephemeral range is free to draw, so the draw falls
    back to the kernel's, still never a reserved one."""
    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._LOWEST + 1000)
    reserved = set(range(ports._LOWEST, ports._LOWEST + 1000))
    got = ports.free_ports(3, reserved=reserved)
    assert len(set(got)) == 3 and not set(got) & reserved, got


@pytest.mark.parametrize("value", ["80,http", "0", "70000", "-5"])
def test_a_malformed_reservation_is_a_clear_error(value):
    from helixserve.config_env import RESERVED_PORTS_ENV, reserved_ports_from

    with pytest.raises(ValueError, match=RESERVED_PORTS_ENV):
        reserved_ports_from({RESERVED_PORTS_ENV: value})
