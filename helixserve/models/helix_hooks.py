"""The helix_a2a hooks of the Kimi forward: how one rank of a ``dp x cp`` world joins its slices.

:class:`~helixserve.models.kimi.KimiForCausalLM` owns one :class:`HelixHooks`; the decoder layers
call it around their mixer and FFN. At a world of one the model does not call the hooks at all
(unless a :class:`PhaseTimer` is set); every row movement is also an identity whenever ``cp == 1``.

A CP group holds the same T rows (its requests' new tokens). Per decoder layer::

    mixer input   all T rows (all-gathered from the row slices, or full rows in the dense region)
      KDA         this rank's H/cp heads and their state slots; o_proj partial sums   [T, D]
      MLA         all heads' absorbed queries over the locally held KV blocks (round-robin
                  ownership, ``-1`` entries elsewhere) -> (o_lat, lse) partials; all-to-all over
                  heads; exact LSE combine; this rank's value heads, gate rows, o_proj columns
    o_proj sums   reduce-scattered: CP rank r keeps rows [r*c, (r+1)*c), c = ceil(T/cp)
    residual      AttnRes bank/prefix, norms and the MoE on those c rows; the MoE dispatches
                  only the rank's valid rows to the experts' owners (all-to-all over the world)

Layers before the first MoE layer (the dense region) keep all T rows: their mixer partials are
summed with reduce-scatter + all-gather; :meth:`HelixHooks.slice_rows` then cuts the residual
stream (and the AttnRes bank) to the rank's c rows. The final norm runs on the slices; the LM head
on the gathered full rows, so every CP rank computes the same logits. A CP group with no work in a
step calls :meth:`HelixHooks.empty_step`: the MoE all-to-alls with zero rows (its experts still
serve the other groups' rows).

Static mode (:meth:`HelixHooks.set_static`, for CUDA graphs of a world step): the MoE dispatch and
combine take the padded all-to-all of :mod:`helixserve.parallel.moe_padded` (equal splits, no host
read, shapes fixed by the capacity), and the MLA LSE all-to-all runs in preallocated buffers
(consumed by the LSE combine right away, so one set serves every layer). The CP row gathers and
reduce-scatters keep allocating their outputs: those become residual-stream tensors that outlive
the next layer's collective (a shared buffer would be overwritten under them), neither reads
anything on the host, and inside a CUDA graph their allocations come from the graph's pool.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Literal, Protocol

import torch
from torch import nn

from helixserve import kernels
from helixserve.models.config import KimiModelConfig
from helixserve.cache_layout import ModelCaches
from helixserve.models.context import ForwardBatch
from helixserve.models.kda import KimiDeltaAttention
from helixserve.models.moe import KimiMoE
from helixserve.models.sharding import HeadShardedMLA
from helixserve.parallel import (
    LseBuffers,
    Mapping,
    ParallelGroups,
    all_gather_rows,
    lse_all_to_all,
    lse_buffers,
    moe_a2a,
    pad_rows,
    reduce_scatter_rows,
    row_chunk,
    rows_for_rank,
    split_rows,
)



class HookedLayer(Protocol):
    """What the hooks read of a decoder layer (``kimi.KimiDecoderLayer``, which imports this module)."""

    layer_idx: int
    is_moe: bool
    self_attn: nn.Module
    block_sparse_moe: nn.Module

    @property
    def ffn(self) -> nn.Module: ...

MoeMode = Literal["sliced", "replicated"]
NO_PHASE: AbstractContextManager[None] = nullcontext()


class PhaseTimer:
    """Wall time per named phase (synchronizing CUDA around each), for benchmarks."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()


def static_moe_capacity(max_step_tokens: int, cp: int, moe_mode: MoeMode = "sliced") -> int:
    """Row slots per destination of the padded MoE all-to-all that no step of the world overflows.

    ``max_step_tokens`` is the step token budget (the most rows T any CP group's step can have:
    the scheduler's ``max_num_batched_tokens``, a decode graph's padded batch included, since
    graphs are captured up to ``max_num_seqs <= max_num_batched_tokens`` rows). A rank routes
    ``c = ceil(T / cp)`` rows (``"sliced"``) or all T (``"replicated"``), and the padded dispatch
    sends each row at most once to each rank, so a rank never sends more than that many rows to
    one destination: the bound is exact (the worst case, every row to one rank's experts, fills it).
    """
    if max_step_tokens < 1 or cp < 1:
        raise ValueError(f"max_step_tokens={max_step_tokens} and cp={cp} must be >= 1")
    return max_step_tokens if moe_mode == "replicated" else row_chunk(max_step_tokens, cp)


class HelixHooks:
    """Row movement and collectives of one world rank (see the module docstring).

    Args:
        moe_mode: ``"sliced"`` (each CP rank routes its c rows) or ``"replicated"`` (each CP rank
            routes all T rows and keeps its slice of the result; the benchmark baseline).

    Static mode (:meth:`set_static`) is a world-wide setting: every step, decode, prefill, mixed
    or empty, takes the padded path, and the padded all-to-all's shapes (``ep * capacity`` row
    slots per MoE layer) must match on every rank of the world. The capacity:

    - dp 1 (the world is one CP group): per step, :func:`static_moe_capacity` of the step's own T,
      exact; T is the same on every rank (one batch), so the ranks agree without a word, and a
      decode graph of n padded rows holds the capacity of n.
    - dp > 1: one capacity for every step, :func:`static_moe_capacity` of the step budget. In one
      world step the DP groups run different batches (group A decodes 8 rows while group B
      prefills 2,048, or idles with 0) and no rank knows the others' without an extra
      collective, so only the bound no step can overflow is world-uniform. The cost: every MoE
      layer of every step moves ``ep * capacity`` rows (and ``ep * capacity * S`` assignment
      slots through the expert kernel, masked ones skipped by the grouped GEMM) however few rows
      it has: a decode step of 8 rows with a 2,048-token budget at cp 1 moves 256 times the rows
      it needs. Worth it where the steps are CUDA graphs (no host sync, no per-step launch cost);
      eagerly on the CPU it is slower (``bench/helix_step.py --static``). (A per-step capacity
      for dp > 1 would need the leaders to agree on the largest T after scheduling: one small
      host collective per world step.)
    """

    def __init__(self, cfg: KimiModelConfig, mapping: Mapping, moe_mode: MoeMode = "sliced") -> None:
        self.cfg = cfg
        self.mapping = mapping
        self.moe_mode = moe_mode
        self.is_world_of_one = mapping.world_size == 1
        self.first_sliced_layer = cfg.moe_layer_ids[0] if cfg.moe_layer_ids else cfg.num_hidden_layers
        self.groups: ParallelGroups | None = None
        self.timer: PhaseTimer | None = None
        self.max_step_tokens: int | None = None  # set: static mode (see set_static)
        self.per_step = False
        self.lse_rows = 0
        self._lse_store: dict[tuple[torch.dtype, torch.dtype, int, int, torch.device], LseBuffers] = {}

    # ---- static mode

    def set_static(self, max_step_tokens: int | None, lse_rows: int | None = None, per_step: bool | None = None) -> None:
        """Static mode on for a world whose steps have at most ``max_step_tokens`` rows (the
        step token budget), or off (``None``). Every rank of the world must set it alike before
        its first step (see the class docstring). ``per_step``: the capacity from each step's T
        (default: at dp 1, the only case where every rank knows every step's T) instead of from
        the budget. ``lse_rows``: the LSE all-to-all of steps of up to that many rows (default
        ``max_step_tokens``; the decode graphs' largest batch is enough) runs in buffers allocated
        once, shared by every MLA layer; larger steps allocate."""
        if max_step_tokens is not None:
            static_moe_capacity(max_step_tokens, self.mapping.cp)  # checks the numbers
        if per_step and self.mapping.dp > 1:
            raise ValueError(f"a per-step MoE capacity needs dp == 1 (the DP groups' T differ), got dp={self.mapping.dp}")
        self.max_step_tokens = max_step_tokens
        self.per_step = self.mapping.dp == 1 if per_step is None else per_step
        self.lse_rows = 0 if max_step_tokens is None else (max_step_tokens if lse_rows is None else lse_rows)
        self._lse_store.clear()

    @property
    def is_static(self) -> bool:
        return self.max_step_tokens is not None

    def moe_capacity(self, num_tokens: int) -> int | None:
        """Row slots per destination of the padded MoE all-to-all in a step of ``num_tokens`` rows
        (``None``: the host-split path)."""
        if self.max_step_tokens is None:
            return None
        rows = num_tokens if self.per_step else self.max_step_tokens
        return static_moe_capacity(max(rows, 1), self.mapping.cp, self.moe_mode)

    def _lse_buffers(self, o: torch.Tensor, lse: torch.Tensor) -> LseBuffers | None:
        """Views of this step's size into the preallocated LSE all-to-all buffers (None: allocate)."""
        num_tokens, num_heads, head_dim = o.shape
        if num_tokens > self.lse_rows:
            return None
        key = (o.dtype, lse.dtype, num_heads, head_dim, o.device)
        full = self._lse_store.get(key)
        if full is None:
            with torch.inference_mode(False):  # plain tensors: written inside and outside inference mode
                full = lse_buffers(self.lse_rows, num_heads, head_dim, self.mapping.cp, o.dtype, lse.dtype, o.device)
            self._lse_store[key] = full

        def rows(buffer: torch.Tensor | None) -> torch.Tensor | None:  # a contiguous prefix [cp, T, h, w]
            if buffer is None:
                return None
            cp, _, heads, width = buffer.shape
            return buffer.view(-1)[: cp * num_tokens * heads * width].view(cp, num_tokens, heads, width)

        return LseBuffers(rows(full.send), rows(full.recv), rows(full.lse_send), rows(full.lse_recv))

    @property
    def moe_mode(self) -> MoeMode:
        return self._moe_mode

    @moe_mode.setter
    def moe_mode(self, mode: MoeMode) -> None:
        if mode not in ("sliced", "replicated"):
            raise ValueError(f"moe_mode must be 'sliced' or 'replicated', got {mode!r}")
        self._moe_mode = mode

    def bind(self, groups: ParallelGroups) -> None:
        if groups.mapping != self.mapping:
            raise ValueError(f"groups are for {groups.mapping}, the model for {self.mapping}")
        self.groups = groups

    @property
    def _groups(self) -> ParallelGroups:
        if self.groups is None:
            raise RuntimeError("KimiForCausalLM.bind(groups) was not called (a world of more than one rank needs it)")
        return self.groups

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.timer(name) if self.timer is not None else NO_PHASE

    # ---- CP-group row movement (identities when cp == 1)

    def gather(self, x_local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Row slices ``[c, ...]`` of the CP group -> the full ``[T, ...]`` rows."""
        if self.mapping.cp == 1:
            return x_local
        with self.phase("cp_gather"):
            return all_gather_rows(x_local, num_tokens, self._groups.cp)

    def scatter(self, x_full: torch.Tensor) -> torch.Tensor:
        """Partial sums ``[T, ...]`` -> this rank's rows of their sum over the CP group ``[c, ...]``."""
        if self.mapping.cp == 1:
            return x_full
        with self.phase("cp_reduce_scatter"):
            return reduce_scatter_rows(x_full, self._groups.cp)

    def slice_rows(self, h: torch.Tensor, bank: torch.Tensor | None, num_banked: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Full rows (and the AttnRes bank ``[K, T, D]``) -> this rank's ``c`` rows, at the first MoE layer."""
        if self.mapping.cp == 1:
            return h, bank
        cp, cp_rank = self.mapping.cp, self.mapping.cp_rank
        h_local = split_rows(h, cp, cp_rank)
        if bank is None:
            return h_local, None
        bank_local = bank.new_zeros(bank.shape[0], h_local.shape[0], *bank.shape[2:])
        if num_banked:
            bank_local[:num_banked] = split_rows(bank[:num_banked].transpose(0, 1), cp, cp_rank).transpose(0, 1)
        return h_local, bank_local

    # ---- the layer hooks

    def mixer(self, layer: HookedLayer, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Mixer of one layer on the rank's rows ``x`` (all T in the dense region, else c) -> the
        mixer output on the same rows (head-sharded partials summed over the CP group)."""
        num_tokens = batch.num_tokens
        is_sliced = layer.layer_idx >= self.first_sliced_layer
        if is_sliced:
            x = self.gather(x, num_tokens)
        out = self.scatter(self._mixer_partial(layer.self_attn, x, batch, caches))
        return out if is_sliced else self.gather(out, num_tokens)

    def _mixer_partial(self, attn: nn.Module, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Head-sharded mixer on all T rows -> o_proj partial sums ``[T, D]`` (the output at cp = 1)."""
        if isinstance(attn, KimiDeltaAttention):
            with self.phase("kda"):
                return attn(x, batch, caches)
        if not isinstance(attn, HeadShardedMLA):  # cp == 1: all heads here
            with self.phase("mla_attend"):
                return attn(x, batch, caches)
        with self.phase("mla_attend"):
            kernels.mla_write_kv(
                caches.mla_kv[attn.layer_idx], batch.block_tables, batch.cu_seqlens, batch.positions, attn.latent(x)
            )
            o_lat, lse = attn.attend(attn.absorbed_query(x), batch, caches)
        with self.phase("cp_lse_a2a"):
            buffers = self._lse_buffers(o_lat, lse) if self.is_static else None
            o_parts, lse_parts = lse_all_to_all(o_lat, lse, self._groups.cp, buffers)
        with self.phase("mla_attend"):
            o_lat, _ = kernels.lse_combine(o_parts, lse_parts)
        with self.phase("mla_output"):
            return attn.output(o_lat, x)

    def ffn(self, layer: HookedLayer, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """FFN of one layer on the rank's rows (normed): the dense MLP in place, the MoE expert-parallel."""
        if not layer.is_moe:
            return layer.ffn(x)
        if self.is_world_of_one:
            with self.phase("moe_local"):
                return layer.ffn(x)
        return self._moe(layer.block_sparse_moe, x, num_tokens)

    def _moe(self, moe: KimiMoE, x_local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """MoE of this rank's row slice ``[c, D]`` (normed); padding rows come back as zeros."""
        cp, cp_rank = self.mapping.cp, self.mapping.cp_rank
        if self.moe_mode == "replicated":
            x = self.gather(x_local, num_tokens)
        else:
            x = x_local if cp == 1 else x_local[: rows_for_rank(num_tokens, cp, cp_rank).num_valid]
        with self.phase("moe_local"):
            expert_in, weights, ids = moe.route(x)
        routed = self._routed_experts(moe, expert_in, weights, ids, num_tokens)
        with self.phase("moe_local"):
            y = moe.finish(routed, x)
        if cp == 1:
            return y
        if self.moe_mode == "replicated":
            return split_rows(y, cp, cp_rank)
        return pad_rows(y, x_local.shape[0])

    def _routed_experts(self, moe: KimiMoE, expert_in: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        num_tokens: int) -> torch.Tensor:
        """Expert-parallel weighted expert sum over the world (``[n, De]``) in a step of T rows."""
        def expert_fn(x_recv: torch.Tensor, local_ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            with self.phase("moe_experts"):
                return moe.routed(x_recv, w[:, None], local_ids[:, None])

        capacity = self.moe_capacity(num_tokens)
        if capacity is not None and expert_in.shape[0] > capacity:
            raise ValueError(f"{expert_in.shape[0]} MoE rows on rank {self.mapping.rank} exceed the static capacity "
                             f"{capacity} (a step of {num_tokens} tokens, budget {self.max_step_tokens}, "
                             f"cp={self.mapping.cp})")
        with self.phase("moe_a2a"):
            return moe_a2a(expert_in, ids, weights, expert_fn, num_experts=self.cfg.num_experts, group=self._groups.ep,
                           capacity=capacity)

    @torch.no_grad()
    def empty_step(self, layers: Sequence[HookedLayer], dtype: torch.dtype, device: torch.device) -> None:
        """Take part in every MoE layer's world all-to-all with zero rows (an idle CP group);
        nothing to join at a world of one."""
        if self.is_world_of_one:
            return
        top_k = self.cfg.num_experts_per_token
        for layer in layers:
            if not layer.is_moe:
                continue
            expert_in = torch.zeros(0, self.cfg.expert_dim, dtype=dtype, device=device)
            ids = torch.zeros(0, top_k, dtype=torch.int64, device=device)
            weights = torch.zeros(0, top_k, dtype=torch.float32, device=device)
            self._routed_experts(layer.block_sparse_moe, expert_in, weights, ids, 0)
