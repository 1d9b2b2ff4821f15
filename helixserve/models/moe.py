"""DeepSeek-V3-style MoE with Kimi's options.

Router: fp32 logits, sigmoid scores; ``e_score_correction_bias`` only steers selection; the chosen
un-biased scores are renormalized and scaled by ``routed_scaling_factor``. Routed experts are
stacked per layer: ``w13 [E, 2I, De]`` (gate rows, then up rows) and ``w2 [E, De, I]``. K3's latent
MoE runs the experts in ``De = routed_expert_hidden_size``: ``x -> routed_expert_down_proj -> experts
-> sum -> routed_expert_norm -> routed_expert_up_proj``. Shared experts see the full ``x``.
The expert stacks may instead stay MXFP4 as the checkpoint stores them
(:meth:`RoutedExperts.use_mxfp4`: ``w13_packed`` / ``w13_scale`` / ``w2_packed`` / ``w2_scale`` uint8
buffers, ``[E, 2I, De/2]`` / ``[E, 2I, De/32]`` / ``[E, De, I/2]`` / ``[E, De, I/32]``); the kernels
take either form (:class:`~helixserve.kernels.MXFP4Weight`).

Split into :meth:`route`, :meth:`routed` and :meth:`finish` so expert parallelism
(:mod:`helixserve.models.helix_hooks`) can dispatch the expert input and sum partial expert outputs
(before the latent norm) in between; an expert-parallel rank holds only its ``num_local_experts``.
"""

from __future__ import annotations

import torch
from torch import nn

from helixserve import kernels
from helixserve.kernels import MXFP4Weight
from helixserve.models.config import KimiModelConfig
from helixserve.models.mlp import GatedMLP, linear
from helixserve.models.norm import RMSNorm
from helixserve.models.packing import column_major, fuse_weights, pack_linears, packed_linear, store_column_major


class Router(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.float().t()


class RoutedExperts(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None, num_experts: int | None = None) -> None:
        """``num_experts``: experts held here (default all; an expert-parallel rank passes its share)."""
        super().__init__()
        E = cfg.num_experts if num_experts is None else num_experts
        I, De = cfg.moe_intermediate_size, cfg.expert_dim
        self.w13 = nn.Parameter(torch.zeros(E, 2 * I, De, dtype=dtype))
        self.w2 = nn.Parameter(torch.zeros(E, De, I, dtype=dtype))
        self.is_mxfp4 = False
        self._views: tuple[MXFP4Weight, MXFP4Weight] | None = None

    def use_mxfp4(self) -> None:
        """Hold the stacks as MXFP4 bytes (uint8 buffers on the parameters' device, zeros) in place
        of the dense parameters; load the checkpoint's bytes into them with ``load_state_dict``."""
        if self.is_mxfp4:
            return
        shapes = {"w13": tuple(self.w13.shape), "w2": tuple(self.w2.shape)}
        device = self.w13.device
        for name, (E, N, K) in shapes.items():
            if K % 32:
                raise ValueError(f"MXFP4 experts need {name}'s input dim to be a multiple of 32, got {K}")
            delattr(self, name)
            self.register_buffer(f"{name}_packed", torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(E, N, K // 32, dtype=torch.uint8, device=device))
        self.is_mxfp4 = True

    def stacks(self) -> tuple[torch.Tensor | MXFP4Weight, torch.Tensor | MXFP4Weight]:
        """(w13, w2) as :func:`helixserve.kernels.moe_experts` takes them (the MXFP4 views are made
        again only when a load or a move replaced the buffers: no checks per step)."""
        if not self.is_mxfp4:
            return self.w13, self.w2
        views = self._views
        if views is None or views[0].packed is not self.w13_packed or views[0].scale is not self.w13_scale \
                or views[1].packed is not self.w2_packed or views[1].scale is not self.w2_scale:
            views = self._views = (MXFP4Weight(self.w13_packed, self.w13_scale),
                                   MXFP4Weight(self.w2_packed, self.w2_scale))
        return views


class KimiMoE(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None = None, num_local_experts: int | None = None) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.activation = cfg.hidden_act
        self.situ_beta = cfg.activation_situ_beta
        self.situ_linear_beta = cfg.activation_situ_linear_beta
        self.gate = Router(cfg, dtype)
        self.experts = RoutedExperts(cfg, dtype, num_local_experts)
        self.is_latent = cfg.routed_expert_hidden_size is not None
        if self.is_latent:
            self.routed_expert_down_proj = linear(cfg.hidden_size, cfg.expert_dim, dtype)
            self.routed_expert_up_proj = linear(cfg.expert_dim, cfg.hidden_size, dtype)
            self.use_latent_norm = cfg.latent_moe_use_norm
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(cfg.expert_dim, cfg.rms_norm_eps, dtype)
        self.shared_experts = (
            GatedMLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, dtype)
            if cfg.num_shared_experts > 0 else None
        )
        # set by pack(): [router (fp32 models) | routed_expert_down_proj | shared gate | shared up] rows
        self.register_buffer("in_proj", None, persistent=False)
        self.register_buffer("in_proj_cols", None, persistent=False)
        self.in_proj_sizes: list[int] = []
        self.is_router_packed = False

    def pack(self, host_forms: bool = True) -> None:
        """Fuse the projections of ``x`` into ``in_proj`` (the router only when it is fp32 like its
        logits) and store the expert stacks column-major (see :mod:`helixserve.models.packing`)."""
        self.is_router_packed = self.gate.weight.dtype == torch.float32
        owners = [self.gate] if self.is_router_packed else []
        owners += [self.routed_expert_down_proj] if self.is_latent else []
        shared = self.shared_experts
        owners += [shared.gate_proj, shared.up_proj] if shared is not None else []
        if owners:
            self.in_proj_sizes = [m.weight.shape[0] for m in owners]
            self.in_proj = fuse_weights([(m, "weight") for m in owners])
            self.in_proj_cols = column_major(self.in_proj) if host_forms else None
        if not host_forms:  # the router's weight in the fp32 of its logits: no cast per step
            self.gate.weight = nn.Parameter(self.gate.weight.detach().float(), requires_grad=False)
            return
        if not self.experts.is_mxfp4:
            store_column_major(self.experts, "w13")
            store_column_major(self.experts, "w2")
        if self.is_latent:
            pack_linears(self, "routed_expert_up_proj")
        if shared is not None:
            pack_linears(shared, "down_proj")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> (expert input ``[T, De]``, topk_weights ``[T, k]`` fp32, topk_ids ``[T, k]``)."""
        weights, ids = self._select(self.gate.logits(x))
        expert_in = self.routed_expert_down_proj(x) if self.is_latent else x
        return expert_in, weights, ids

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.moe_route(
            logits, top_k=self.top_k, correction_bias=self.gate.e_score_correction_bias,
            renormalize=self.renormalize, routed_scaling_factor=self.routed_scaling_factor,
        )

    def routed(
        self, expert_in: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        w13: torch.Tensor | None = None, w2: torch.Tensor | None = None, expert_offset: int = 0,
    ) -> torch.Tensor:
        """Weighted sum over the selected experts held in ``w13``/``w2`` (default: all) -> ``[T, De]``."""
        own_w13, own_w2 = self.experts.stacks()
        return kernels.moe_experts(
            expert_in, ids, weights, own_w13 if w13 is None else w13, own_w2 if w2 is None else w2,
            expert_offset=expert_offset, activation=self.activation,
            situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
        )

    def finish(self, routed_sum: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Latent norm + up projection (K3) and the shared experts -> ``[T, hidden]``."""
        y = self._latent_out(routed_sum.to(x.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def _latent_out(self, y: torch.Tensor) -> torch.Tensor:
        if self.is_latent:
            if self.use_latent_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_proj is None:
            expert_in, weights, ids = self.route(x)
            return self.finish(self.routed(expert_in, weights, ids), x)
        routed, shared = self.forward_parts(x)
        return routed if shared is None else routed + shared

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed and the shared experts' outputs ``[T, hidden]`` (``None``: no shared experts),
        whose sum is :meth:`forward`'s: the caller adds them in its next kernel (packed modules)."""
        if self.in_proj is None:
            return self.forward(x), None
        parts = list(packed_linear(x, self.in_proj, self.in_proj_cols).split_with_sizes(self.in_proj_sizes, dim=-1))
        weights, ids = self._select(parts.pop(0) if self.is_router_packed else self.gate.logits(x))
        expert_in = parts.pop(0) if self.is_latent else x
        y = self._latent_out(self.routed(expert_in, weights, ids).to(x.dtype))
        return y, self.shared_experts.down(*parts) if self.shared_experts is not None else None
