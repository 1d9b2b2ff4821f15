"""Picking a data plane: the backend class for a :class:`~helixserve.config_transceiver.TransceiverBackendKind`,
imported when chosen (ucxx is an optional extra; the fake serves tests only), and the plane a KV
sender or receiver opens. Above :mod:`.plane` and every backend, which import the seam, not this."""

from __future__ import annotations

import threading

from helixserve.config_transceiver import TransceiverBackendKind, TransceiverConfig
from helixserve.transceiver.plane import DataPlane


def load_data_plane(kind: TransceiverBackendKind) -> type[DataPlane]:
    """The DataPlane class for `kind`, imported lazily (ucxx is only needed when chosen)."""
    if kind is TransceiverBackendKind.UCXX:
        from helixserve.transceiver.ucxx_backend import UcxxDataPlane

        return UcxxDataPlane
    if kind is TransceiverBackendKind.FAKE:
        from helixserve.transceiver.fake import FakeDataPlane

        return FakeDataPlane
    raise ValueError(f"unknown transceiver backend {kind!r}")


def open_data_plane(config: TransceiverConfig, wakeup: threading.Event, host: str | None = None,
                    peer_hosts: tuple[str, ...] = ()) -> DataPlane:
    """THE way a KV sender or receiver gets its plane: the `config.backend` class's
    `for_transceiver(config, wakeup, host, peer_hosts)`."""
    return load_data_plane(config.backend).for_transceiver(config, wakeup, host, tuple(peer_hosts))
