"""Which network devices a UCX context may use, so that its TCP transport listens on the
worker's own interface only (UCX's default, every device, listens on every interface).

``UCX_NET_DEVICES`` restricts UCX's network transports: TCP listens only on the named interfaces;
RDMA devices (``mlx5_0:1``) are kept, they open no TCP listener. Shared memory is not a network
device and is unaffected. Linux only (``SIOCGIFADDR``, ``/proc/net/if_inet6``, ``/sys``); where the
interface cannot be found, ``None`` leaves UCX's default and the caller logs it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

ALL_DEVICES = "all"
_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    found = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return found


def interface_with(address: str) -> str | None:
    """The name of the interface that holds ``address`` (an IP), or None."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return "lo" if ip.is_loopback else None  # 127.0.0.0/8: lo holds it all


def rdma_devices() -> list[str]:
    """``device:port`` of every RDMA port (``/sys/class/infiniband``)."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return []
    return [f"{dev.name}:{port.name}" for dev in sorted(root.iterdir())
            for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir()]


def _resolve(host: str) -> str:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def local_address_toward(hosts: Iterable[str]) -> str | None:
    """This machine's address on the route to the first resolvable of ``hosts`` (no packet is
    sent: a UDP socket's connect only picks the route)."""
    for host in hosts:
        try:
            address = _resolve(host)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((address, 9))
                return sock.getsockname()[0]
        except OSError:
            continue
    return None


def net_devices_for(host: str | None) -> str | None:
    """``UCX_NET_DEVICES`` for a worker whose address is ``host``: its interface plus the RDMA
    ports; None (UCX's default) when ``host`` is a wildcard or its interface is unknown."""
    if not host:
        return None
    try:
        address = _resolve(host)
    except OSError:
        logger.warning("UCX: cannot resolve %s; its TCP transport listens on every interface", host)
        return None
    if ipaddress.ip_address(address).is_unspecified:
        return None
    name = interface_with(address)
    if name is None:
        logger.warning("UCX: no interface holds %s (%s); its TCP transport listens on every interface",
                       host, address)
        return None
    return ",".join([name, *rdma_devices()])


def ucx_net_devices(configured: str | None, host: str | None, peer_hosts: Iterable[str] = ()) -> str | None:
    """``TransceiverConfig.ucx_net_devices`` resolved for a worker at ``host``: ``"all"`` -> None
    (UCX's default), a list as given, None -> :func:`net_devices_for` ``host`` (``host`` None: this
    machine's address on the route to ``peer_hosts``, :func:`local_address_toward`)."""
    if configured == ALL_DEVICES:
        return None
    if configured:
        return configured
    return net_devices_for(host if host is not None else local_address_toward(peer_hosts))
