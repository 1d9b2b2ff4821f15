"""The cache layout: what one rank's cache of a Kimi model is made of (torch and stdlib only).

The one place models (which read and write the caches), kvcache (which allocates and sizes them)
and the transceiver (which moves their bytes) learn the layout from; it imports no helixserve
module, so none of the three has to import another for it.

Tensors, per 0-based decoder layer id (:class:`ModelCaches`; shapes of :class:`CacheSpec`):

- ``mla_kv[l]`` (MLA layers): ``[num_blocks, tokens_per_block, kv_lora_rank + qk_rope_head_dim]``
  in the model dtype. A request's block table maps its *global logical* block ``b`` to a physical
  block, ``-1`` when that block is not held on this rank (helix CP shards blocks round-robin:
  block ``b`` lives on CP rank ``b % cp``; on a single process every used entry is ``>= 0``).
- ``kda_state[l]`` (KDA layers): ``[num_slots, H_local, K, V]`` float32 ([K, V] layout).
- ``conv_state[l]`` (KDA layers): ``[num_slots, 3 * H_local * K, W - 1]`` (sections ``[q | k | v]``),
  the last ``W - 1`` inputs of the short convolutions, in the model dtype.

``H_local`` is the rank's KDA head count: CP rank ``r`` of ``c`` holds heads
``[r*H/c, (r+1)*H/c)`` (:func:`head_slice`), all of them on a single process.

A hidden drafter's prompt cache travels with a request (``ModelCaches.draft``, :class:`DraftCaches`):
its MLA pools ``[pages, tokens_per_block, kv_lora_rank + qk_rope_head_dim]`` on full rows, and
``features`` ``[num_slots, feature_size]`` in the model dtype, the target's features at a held or
received request's last prompt position, at its KDA state slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class DraftCaches:
    """A hidden drafter's prompt cache as the transceiver moves it (module docstring): its MLA
    pools by the drafter's layer id, its feature rows by slot, a request's pages in those pools
    (``block_table``, on the engine thread), and the requests whose cache arrived (``received``:
    the receiver adds, the drafter takes)."""

    mla_kv: dict[int, torch.Tensor]
    features: torch.Tensor
    block_table: Callable[[str], list[int]]
    received: set[str] = field(default_factory=set)


@dataclass(slots=True)
class ModelCaches:
    """Cache tensors keyed by 0-based decoder layer index (layouts in the module docstring);
    ``draft``: a hidden drafter's prompt cache, where it travels with the requests (not one of
    `tensors`: the model's forward never reads it)."""

    tokens_per_block: int
    mla_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_state: dict[int, torch.Tensor] = field(default_factory=dict)
    conv_state: dict[int, torch.Tensor] = field(default_factory=dict)
    draft: DraftCaches | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor: the MLA pools, then the KDA states, then the conv states."""
        return [*self.mla_kv.values(), *self.kda_state.values(), *self.conv_state.values()]

    def identity(self) -> tuple[int, ...]:
        """The ids of the tensor objects in `tensors` order: equal to an earlier identity
        while the tensors it was taken of live, the same ones in the same places. A caller
        compares it only while it keeps those tensors alive (or learns of their death): ids are
        reused after it."""
        return tuple(map(id, self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """What the cache pools of one rank look like. Layer ids are 0-based decoder layer indices."""

    mla_layer_ids: tuple[int, ...]
    kda_layer_ids: tuple[int, ...]
    kv_lora_rank: int
    qk_rope_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    dtype: torch.dtype
    tokens_per_block: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "mla_layer_ids", tuple(self.mla_layer_ids))
        object.__setattr__(self, "kda_layer_ids", tuple(self.kda_layer_ids))
        overlap = set(self.mla_layer_ids) & set(self.kda_layer_ids)
        if overlap:
            raise ValueError(f"layers {sorted(overlap)} are listed as both MLA and KDA")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        positive = {"tokens_per_block": self.tokens_per_block}
        if self.mla_layer_ids:
            positive |= {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim}
        if self.kda_layer_ids:
            positive |= {
                "kda_num_heads": self.kda_num_heads,
                "kda_head_dim": self.kda_head_dim,
                "conv_kernel_size": self.conv_kernel_size,
            }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def mla_entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def conv_channels(self) -> int:
        return 3 * self.kda_num_heads * self.kda_head_dim


class CacheGeometry(Protocol):
    """The model-config fields the layout is made of (``models.config.KimiModelConfig`` has them)."""

    @property
    def mla_layer_ids(self) -> list[int]: ...
    @property
    def kda_layer_ids(self) -> list[int]: ...
    kv_lora_rank: int
    qk_rope_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int


def cache_spec_for(
    cfg: CacheGeometry, dtype: torch.dtype, tokens_per_block: int, kda_num_heads: int | None = None
) -> CacheSpec:
    """The cache layout of ``cfg``; ``kda_num_heads`` overrides the head count (a rank's slice)."""
    return CacheSpec(
        mla_layer_ids=tuple(cfg.mla_layer_ids),
        kda_layer_ids=tuple(cfg.kda_layer_ids),
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        kda_num_heads=kda_num_heads if kda_num_heads is not None else cfg.kda_num_heads,
        kda_head_dim=cfg.kda_head_dim,
        conv_kernel_size=cfg.conv_kernel_size,
        dtype=dtype,
        tokens_per_block=tokens_per_block,
    )


def head_slice(num_heads: int, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """KDA heads ``[r*H/c, (r+1)*H/c)`` of CP rank `cp_rank`; H must be divisible by `cp_size`."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank} cp_size={cp_size}")
    if num_heads % cp_size:
        raise ValueError(f"{num_heads} KDA heads cannot be split over cp_size={cp_size}")
    share = num_heads // cp_size
    return cp_rank * share, (cp_rank + 1) * share
