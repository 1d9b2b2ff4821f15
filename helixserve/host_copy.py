"""Host -> device copies that do not make the host wait.

A copy from pageable host memory synchronizes the stream first (the CUDA driver stages it), so the
host waits for every queued kernel, e.g. the step in flight: the next step's inputs could not be
prepared while the device ran. From pinned memory the copy is asynchronous; PyTorch's caching host
allocator keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``; from a CPU tensor to a GPU through pinned memory, without blocking."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
