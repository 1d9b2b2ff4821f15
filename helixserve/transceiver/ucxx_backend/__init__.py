"""UCX data plane through `ucxx` (imported only when this backend is chosen)."""

from helixserve.transceiver.ucxx_backend.plane import UcxxDataPlane, UcxxHandle

__all__ = ["UcxxDataPlane", "UcxxHandle"]
