"""Load-time weight packing for the single-process CPU path (vLLM-style packed modules).

Invisible to the checkpoint names, ``state_dict()`` and ``named_parameters()`` (the added tensors
are non-persistent buffers):

- fused input projections: the projections of one module that read the same input share one
  ``[sum of outputs, in]`` weight (``in_proj``), so a step runs one GEMM and splits its output
  instead of one GEMM per projection; each original weight becomes a view of its row block, so the
  parameter values (and in-place updates of them) are the fused weight's;
- GEMM forms picked by the number of rows, because MKL's speed on CPU depends on them when the
  weights come from memory rather than cache (decode): one row reads a column-major (``[in, out]``
  contiguous) copy about 1.7x faster, 2..64 rows run ``(W @ x^T)^T`` on the row-major weight (up to
  ~1.7x faster with two threads); more rows (prefill) keep ``F.linear``. So linear weights other
  than the routed experts are held twice (``*_cols`` copies); the expert stacks, read a few rows
  at a time, are stored column-major once.

Each layer class says what it fuses in its ``pack()`` method, which also packs its submodules;
:func:`pack_for_cpu` calls the outermost ones; on a GPU :func:`pack_for_inference` fuses the input
projections only (no ``*_cols`` copies: one GEMM and no concatenation per module input in a decode
step). The rank-sharded models of a larger world are not packed (their
layers keep ``in_proj = None`` and run the per-projection path). After ``model.to(...)`` the views,
the fused weights and their copies are separate tensors with equal values; pack after moving.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# up to this many rows, the row-major weight is streamed as (W @ x^T)^T
_ROWS_GEMM_MAX_M = 64


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([out, in] or [E, out, in]) with its last two dims stored transposed; same values."""
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, weight_cols: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [M, in]`` in the GEMM form for M (see module docstring);
    ``weight_cols``: the column-major copy of ``weight`` (``None``: plain ``F.linear``)."""
    if weight_cols is None or x.dim() != 2 or x.shape[0] > _ROWS_GEMM_MAX_M:
        return F.linear(x, weight)
    if x.shape[0] == 1:
        return F.linear(x, weight_cols)
    return torch.mm(weight, x.t()).t().contiguous()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` without bias (same ``weight`` parameter) that also holds ``weight_cols``."""

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        if linear.bias is not None:
            raise ValueError("PackedLinear packs bias-free linears only")
        packed = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        packed.weight = linear.weight
        packed.register_buffer("weight_cols", column_major(linear.weight), persistent=False)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.weight_cols)


def pack_linears(parent: nn.Module, *names: str) -> None:
    """Replace ``parent.<name>`` linears by :class:`PackedLinear` (same parameter, same name)."""
    for name in names:
        setattr(parent, name, PackedLinear.of(getattr(parent, name)))


def fuse_weights(owners: Sequence[tuple[nn.Module, str]], is_column_major: bool = False) -> torch.Tensor:
    """One ``[sum of rows, in]`` weight stacking the ``(module, name)`` weights in order (stored
    column-major if asked); each of them becomes a view of its row block."""
    weights = [getattr(module, name).detach() for module, name in owners]
    first = weights[0]
    if any(w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
           for w in weights):
        raise ValueError(f"cannot fuse weights of shapes {[tuple(w.shape) for w in weights]}")
    rows = sum(w.shape[0] for w in weights)
    if is_column_major:
        fused = torch.empty(first.shape[1], rows, dtype=first.dtype, device=first.device).t()
    else:
        fused = torch.empty(rows, first.shape[1], dtype=first.dtype, device=first.device)
    start = 0
    for (module, name), w in zip(owners, weights, strict=True):
        block = fused[start:start + w.shape[0]]
        block.copy_(w)
        setattr(module, name, nn.Parameter(block, requires_grad=False))
        start += w.shape[0]
    return fused


def store_column_major(module: nn.Module, name: str) -> None:
    """Store the parameter ``module.<name>`` column-major (same values)."""
    setattr(module, name, nn.Parameter(column_major(getattr(module, name)), requires_grad=False))


@torch.no_grad()
def pack_for_cpu(model: nn.Module) -> nn.Module:
    """Pack every layer of a loaded single-process model that lives on the CPU (see module docstring)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return model
    _pack_tree(model, is_root=True, host_forms=True)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(lm_head, nn.Linear) and (embed is None or lm_head.weight is not embed.weight):
        pack_linears(model, "lm_head")
    return model


@torch.no_grad()
def pack_for_inference(model: nn.Module) -> nn.Module:
    """Pack a loaded single-process model where it lives: on the CPU :func:`pack_for_cpu`; on one
    device the fused input projections and conv kernels only (one GEMM per module input and no
    per-step concatenation; no column-major copies: cuBLAS picks its own form)."""
    devices = {p.device.type for p in model.parameters()}
    if devices == {"cpu"}:
        return pack_for_cpu(model)
    if len(devices) == 1 and "meta" not in devices:
        _pack_tree(model, is_root=True, host_forms=False)
    return model


def _pack_tree(module: nn.Module, is_root: bool = False, host_forms: bool = True) -> None:
    """Call ``pack`` on the outermost modules that have one (each packs its own submodules)."""
    if not is_root and hasattr(module, "pack"):
        module.pack(host_forms)
        return
    for child in module.children():
        _pack_tree(child, host_forms=host_forms)
