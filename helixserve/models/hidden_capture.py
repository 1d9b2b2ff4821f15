"""The target's hidden states a hidden-state drafter reads (EAGLE-3 class, ``speculative.method:
hidden``): the outputs of chosen decoder layers for every row of a forward.

The one model forward (:class:`~helixserve.models.kimi.KimiModel`) hands each layer's output to
``batch.hidden_capture`` when the batch carries one; a plain forward carries none and keeps
nothing. A layer's output is its residual stream after the FFN (with attention residuals: the
block's running sum, what the next layer reads as its prefix).

**In a helix world** (dp x cp): the layers before the first MoE layer (the dense region) run all T
rows of the CP group's step on every CP rank, so their outputs are the group's rows as they come.
From the first MoE layer on, the residual stream is token-sliced: CP rank ``r`` holds only rows
``[r*c, (r+1)*c)`` (``c = ceil(T/cp)``, zero-padded), the MoE included. So a layer there holds a
slice, not the group's rows: :meth:`HiddenCapture.gather_sliced` all-gathers every kept sliced
layer's output over the CP group once per forward (one collective for all of them, the padding
trimmed). Every rank of the group keeps the same layers (the ranks' runners are built alike), so
the collective matches on every rank; after it every CP rank holds the group's rows' hidden states,
the leader (which drafts) included. Across DP groups nothing moves: each group drafts its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
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

    def gather_sliced(self, first_sliced_layer: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the kept outputs of layers ``>= first_sliced_layer`` (this rank's row slices
        ``[c, hidden]``) by the CP group's rows ``[T, hidden]``: ``gather`` (the hooks' row
        all-gather) runs once on them side by side (see the module docstring)."""
        sliced = [i for i in self.layer_ids if i >= first_sliced_layer and i in self.states]
        if not sliced:
            return
        full = gather(torch.cat([self.states[i] for i in sliced], dim=-1))
        for i, part in zip(sliced, full.split([self.states[i].shape[-1] for i in sliced], dim=-1)):
            self.states[i] = part
