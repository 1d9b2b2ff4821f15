"""Free TCP ports for local worlds and tests, chosen outside the kernel's ephemeral range.

A port found with ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range the kernel draws from for every
outgoing connection and every other ``bind(0)``: between finding it and binding it for real
(a launcher that first makes a checkpoint takes seconds) a gloo pair or a UCX endpoint of a
neighbour can take it. A port below that range is never handed out by the kernel, so only
another caller choosing explicitly can collide, and the ones of this process never do (each
port is handed out once per process). Where the range cannot be read, ``bind(0)`` it is.

A launcher's children are separate processes, each drawing its own: a ctx worker's world
rendezvous once drew the gen worker's configured port before that worker bound it (CI: ``address
already in use`` on the gen port). Callers pass ``reserved`` (``config.reserved_ports()``, the
ports the launcher named) and none of them is handed out.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_given: set[int] = set()
_rng = random.Random()  # seeded by the OS: two processes must not draw the same sequence


def _ephemeral_low() -> int | None:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", reserved: Collection[int] = ()) -> list[int]:
    """``n`` distinct TCP ports bindable on ``host`` now, below the ephemeral range when there
    is room there, never one this process handed out before nor one of ``reserved``."""
    low = _ephemeral_low()
    taken = _given | set(reserved)
    ports: list[int] = []
    if low is not None and low - _LOWEST >= 1000:
        for _ in range(200 * n):
            if len(ports) == n:
                break
            port = _rng.randrange(_LOWEST, low)
            if port not in taken and port not in ports and _bindable(host, port):
                ports.append(port)
    while len(ports) < n:
        port = _kernel_port(host)
        if port not in taken and port not in ports:
            ports.append(port)
    _given.update(ports)
    return ports


def free_port(host: str = "127.0.0.1", reserved: Collection[int] = ()) -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1, host, reserved)[0]
