"""The target's hidden states a hidden-state drafter reads (EAGLE-3 class, ``speculative.method:
hidden``): the outputs of chosen decoder layers for every row of a forward.

The one model forward (:class:`~helixserve.models.kimi.KimiModel`) hands each layer's output to
``batch.hidden_capture`` when the batch carries one; a plain forward carries none and keeps
nothing. A layer's output is its residual stream after the FFN (with attention residuals: the
block's running sum, what the next layer reads as its prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class HiddenCapture:
    """Outputs of the decoder layers ``layer_ids`` (0-based, in the order the drafter reads them)."""

    layer_ids: tuple[int, ...]
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Keep layer ``layer_idx``'s output ``[T, hidden]`` when it is one of ``layer_ids``."""
        if layer_idx in self.layer_ids:
            self.states[layer_idx] = hidden

    def features(self) -> torch.Tensor:
        """``[T, len(layer_ids) * hidden]``: the kept outputs side by side, in ``layer_ids`` order."""
        missing = [i for i in self.layer_ids if i not in self.states]
        if missing:
            raise ValueError(f"the forward kept no output of layers {missing} (the model has fewer layers?)")
        return torch.cat([self.states[i] for i in self.layer_ids], dim=-1)
