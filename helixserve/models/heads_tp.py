"""A draft model's forward on its heads-TP mapping (:attr:`~helixserve.parallel.Mapping.heads_tp`):
the ranks of one CP group run every row of a draft step in lockstep, each with its share of the
attention heads (tensor parallelism over the CP group, the target's helix layout untouched).

Per decoder layer, on all T rows of every rank::

    mixer     KDA: this rank's H/cp heads and their state slots (as the target's helix rank);
              MLA: this rank's H/cp heads (queries, attention over the latent cache, value heads,
              gate rows); the latent KV is head-independent, so every rank writes and holds every
              token's latent row (the full-row pages), and attends its heads over all of them
    o_proj    row-parallel: this rank's heads' columns -> partial sums [T, D], all-reduced over
              the CP group (every rank gets the same sum)
    FFN       the dense MLP or the MoE, replicated (every expert on every rank)
    LM head   replicated, on full rows: every rank computes the same logits and argmax, so every
              rank knows the drafts without a broadcast

Nothing crosses CP groups (no world-wide all-to-all), so a DP group drafts on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.helix_hooks import HelixHooks, HookedLayer
from helixserve.parallel import Mapping, ParallelGroups, all_reduce_sum


class HeadsTPHooks(HelixHooks):
    """The hooks of a heads-TP draft model (see the module docstring): an all-reduce after each
    mixer, the FFN in place, no row slicing. Bound to the target's groups of the same rank (their
    CP group is the draft's group)."""

    def __init__(self, cfg: KimiModelConfig, mapping: Mapping) -> None:
        if not mapping.heads_tp:
            raise ValueError(f"HeadsTPHooks needs a heads_tp mapping, got {mapping}")
        super().__init__(cfg, mapping)
        self.first_sliced_layer = cfg.num_hidden_layers  # every layer runs on all rows

    def bind(self, groups: ParallelGroups) -> None:
        if (groups.mapping.cp, groups.mapping.cp_rank) != (self.mapping.cp, self.mapping.rank):
            raise ValueError(f"groups are for {groups.mapping}, the draft model for CP rank {self.mapping.rank} "
                             f"of {self.mapping.cp}")
        self.groups = groups

    def set_static(self, max_step_tokens: int | None, lse_rows: int | None = None, per_step: bool | None = None) -> None:
        raise ValueError("a heads-TP draft model runs eagerly (no static mode)")

    def gather(self, x_local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return x_local  # rows are never sliced

    def mixer(self, layer: HookedLayer, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """This rank's heads' o_proj partial sums ``[T, D]``, summed over the CP group."""
        with self.phase("tp_mixer"):
            partial = layer.self_attn(x, batch, caches)
        with self.phase("tp_all_reduce"):
            return all_reduce_sum(partial, self._groups.cp)

    def ffn(self, layer: HookedLayer, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return layer.ffn(x)  # replicated

    def empty_step(self, layers: Sequence[HookedLayer], dtype: torch.dtype, device: torch.device) -> None:
        """Nothing to join: a draft model has no world-wide collective."""
