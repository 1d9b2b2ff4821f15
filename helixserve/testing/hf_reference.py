"""A random-weight transformers ``KimiLinearForCausalLM``: the independent reference that tests
and benchmarks run next to helixserve on the same checkpoint. Needs ``transformers``."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from helixserve.models.config import KimiModelConfig


@torch.no_grad()
def randomize_hf_weights(model: torch.nn.Module, seed: int) -> None:
    """Scales that make every block matter (HF's 0.02-std init would leave the logits near zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("A_log"):
            value = torch.log(torch.rand(p.shape, generator=gen) * 15 + 1)
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen) * math.log(100) + math.log(1e-3))
            value = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("e_score_correction_bias"):
            value = torch.randn(p.shape, generator=gen) * 0.05
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            value = 1 + 0.2 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        p.copy_(value)


def build_hf_reference(cfg: KimiModelConfig, out: str | Path, seed: int = 0,
                       attn_implementation: str | None = None) -> torch.nn.Module:
    """A random fp32 transformers ``KimiLinearForCausalLM`` shaped like ``cfg`` (in eval mode),
    saved to ``out`` with ``save_pretrained`` (which helixserve loads). ``attn_implementation``
    (e.g. ``"eager"``) overrides the one transformers would pick."""
    import transformers

    hf_cfg = transformers.KimiLinearConfig.from_dict(cfg.to_hf_dict())
    if attn_implementation is not None:
        hf_cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    hf = transformers.KimiLinearForCausalLM(hf_cfg).eval()
    randomize_hf_weights(hf, seed=seed)
    hf.save_pretrained(out)
    return hf
