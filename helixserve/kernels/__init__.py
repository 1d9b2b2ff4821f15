"""helixserve.kernels: one public function per op.

Each function validates its arguments (ValueError naming the bad value) and dispatches to an
implementation; today that is the vectorized PyTorch path (device-agnostic). GPU fast paths
plug in behind the same functions. Loop-form fp32 references live in ``<op>/naive.py``.
"""

from __future__ import annotations

from helixserve.kernels.attn_res.mix import attn_res_mix, attn_res_mix_norm
from helixserve.kernels.kda.chunk import kda_chunk_prefill
from helixserve.kernels.kda.gate import kda_gate, kda_gate_beta
from helixserve.kernels.kda.recurrent import kda_recurrent_step
from helixserve.kernels.mla.combine import lse_combine
from helixserve.kernels.mla.paged import mla_paged_attention, mla_write_kv
from helixserve.kernels.moe.experts import act_and_mul, moe_experts
from helixserve.kernels.moe.mxfp4 import MXFP4Weight, dequantize_mxfp4
from helixserve.kernels.moe.route import moe_route
from helixserve.kernels.norm.rms import add_rms_norm, gated_rms_norm, rms_norm, rms_norm_leading
from helixserve.kernels.short_conv.conv import short_conv_prefill, short_conv_step

__all__ = [
    "MXFP4Weight",
    "act_and_mul",
    "add_rms_norm",
    "attn_res_mix",
    "attn_res_mix_norm",
    "dequantize_mxfp4",
    "gated_rms_norm",
    "kda_chunk_prefill",
    "kda_gate",
    "kda_gate_beta",
    "kda_recurrent_step",
    "lse_combine",
    "mla_paged_attention",
    "mla_write_kv",
    "moe_experts",
    "moe_route",
    "rms_norm",
    "rms_norm_leading",
    "short_conv_prefill",
    "short_conv_step",
]
