"""``/metrics`` of a server's client connections, read at scrape time from its
:class:`~helixserve.serving.connections.ConnectionGuard`: ``<prefix>_connections_open`` (a gauge)
and ``<prefix>_connections_closed_total{reason}`` (connections the server closed: idle_timeout,
header_timeout, body_timeout, evicted at max_connections, refused). The router's prefix is
``helixserve_router``; a worker's is ``helixserve_worker`` with its ``role`` label, as its other
metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from helixserve.serving.connections import ConnectionGuard

# (open now, closed by reason), or None when the app is not served by helixserve's uvicorn set-up
ConnectionCounts = Callable[[], tuple[int, Mapping[str, int]] | None]


class ConnectionCollector:
    """A prometheus collector of one server's connection counts; ``labels``: constant labels
    (a worker's ``{"role": "ctx"}``)."""

    def __init__(self, prefix: str, counts: ConnectionCounts, labels: Mapping[str, str] | None = None) -> None:
        self._prefix = prefix
        self._counts = counts
        self._labels = dict(labels or {})

    def collect(self):  # noqa: ANN201 (prometheus collector protocol)
        state = self._counts()
        if state is None:
            return
        num_open, num_closed = state
        names, values = list(self._labels), list(self._labels.values())
        gauge = GaugeMetricFamily(f"{self._prefix}_connections_open", "open client connections", labels=names)
        gauge.add_metric(values, num_open)
        yield gauge
        closed = CounterMetricFamily(f"{self._prefix}_connections_closed",
                                     "client connections this server closed, by reason (idle_timeout, "
                                     "header_timeout, body_timeout, evicted at max_connections, refused)",
                                     labels=[*names, "reason"])
        for reason, count in sorted(num_closed.items()):
            closed.add_metric([*values, reason], count)
        yield closed


def guard_counts(guard: ConnectionGuard | None) -> tuple[int, dict[str, int]] | None:
    """``guard``'s counts: the guard :func:`~helixserve.serving.http.build_server` puts on
    ``app.state.connection_guard`` (None before, or when another server runs the app)."""
    return None if guard is None else (len(guard.open), dict(guard.num_closed))
