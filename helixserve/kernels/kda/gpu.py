"""KDA on the GPU through fla-core's Triton kernels (the optional ``gpu`` extra).

Layout adaptation only: our flat varlen rows ``[T, H, *]`` become fla's ``[1, T, H, *]`` by a view;
the recurrent state stays in our ``[S, H, K, V]`` fp32 pool ([K, V] layout = fla's default,
``state_v_first=False``).

- Prefill: ``chunk_kda`` with ``cu_seqlens``, the gathered initial states, ``output_final_state``.
- Decode: fla's fused recurrent kernel with ``ssm_state_indices`` = our slot ids and the final
  state written in place: each sequence's state is read from and written back to its pool slot,
  no gather/scatter copies. (fla's public ``fused_recurrent_kda`` does not forward the slot
  indices; we launch the kernel as its ``fused_recurrent_kda_fwd`` does, which vLLM also calls.)
"""

from __future__ import annotations

import torch


def chunk_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla ``chunk_kda`` over our varlen layout; returns (o [T, H, V] in v.dtype, final [N, H, K, V] fp32)."""
    from fla.ops.kda import chunk_kda

    cu = None
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    o, final_state = chunk_kda(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu,
    )
    return o[0].to(v.dtype), final_state


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    """fla fused recurrent step, states updated in place at ``slot_ids``; returns o [B, H, V] in v.dtype.

    Launches fla's kernel directly with the arguments its ``fused_recurrent_kda_fwd`` passes for
    T = 1 (our [B, H, *] rows are its [B, 1, H, *] rows in memory): no 4-D views, no zero-filled
    output, fewer Python steps per decode layer. Falls back to that wrapper if the kernel's
    signature differs (another fla version).
    """
    global _direct_launch
    q, k, v, g, beta = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v, g, beta))
    assert state_pool.is_contiguous()
    if _direct_launch:
        try:
            return _launch_recurrent(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm)
        except TypeError:
            _direct_launch = False
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(
        q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.unsqueeze(1), beta=beta.unsqueeze(1),
        scale=scale, initial_state=state_pool, inplace_final_state=True, ssm_state_indices=slot_ids,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o[:, 0]


_direct_launch = True
_BV = 32  # fla's value block for this kernel


def _launch_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    import triton
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

    B, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    stride_state = state_pool.stride(0)
    fused_recurrent_kda_fwd_kernel[(triton.cdiv(V, _BV) * B * H,)](
        q=q, k=k, v=v, g=g, beta=beta, A_log=None, dt_bias=None, o=o, h0=state_pool, ht=state_pool,
        cu_seqlens=None, ssm_state_indices=slot_ids, num_accepted_tokens=None, lower_bound=None,
        scale=scale, N=B, T=1, H=H, HV=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=_BV,
        stride_init_state_token=stride_state, stride_final_state_token=stride_state,
        stride_indices_seq=slot_ids.stride(0), stride_indices_tok=1,
        IS_BETA_HEADWISE=False, USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm, INPLACE_FINAL_STATE=True,
        USE_GATE_IN_KERNEL=False, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False,
        num_warps=4, num_stages=2,
    )
    return o
