"""A hidden-state drafter (EAGLE-3 class) for ``speculative.method: hidden``: a small Kimi-architecture
model (MLA decoder layers, dense MLP, RMSNorms) that reads the target's hidden states.

Row ``i`` of the drafter (its position ``i`` in the sequence) reads the embedding of token ``x_i``
and a feature vector ``f_i`` and predicts ``x_{i+1}``:

    x = combine([norm(f_i) | norm(embed(x_i))])   # RMSNorms, concat, project to hidden_size
    x = layer_N(...layer_1(x))                      # Kimi MLA layers with a dense gated MLP
    logits = lm_head(norm(x))

``f_i = fc([h^{l_1}_{i-1} | ... | h^{l_k}_{i-1}])`` where ``h^l_{i-1}`` is the output of the target's
decoder layer ``l`` at position ``i - 1`` (``hidden_layers`` in the checkpoint, 0-based; zeros at
``i = 0``); a draft row after the first (draft ``j > 1``) reads the drafter's own output ``x`` of the
row before instead of ``f`` (as EAGLE does). The embedding and the LM head are the drafter's own
(not tied to the target's).

Checkpoint: ``config.json`` is a Kimi config (``model_type: kimi_linear``) of the drafter's layers
plus a ``hidden_drafter`` object (:class:`~helixserve.models.hidden_drafter_config.HiddenDrafterSpec`,
read torch-free there); ``model.safetensors`` holds
``model.embed_tokens``, ``model.layers.*``, ``model.norm``, ``lm_head``, ``fc``, ``feature_norm``,
``embed_norm`` and ``combine`` weights under those names.

**Heads TP** (``mapping.heads_tp``, ``speculative.draft_tensor_parallel_size`` = the world's
``cp``): each rank of a CP group holds its ``H/cp`` MLA heads of every layer (read as a draft
model's heads are, :func:`~helixserve.models.helix_load.read_rank_param`) and runs every row, the
o_proj partial sums all-reduced over the group (:class:`~helixserve.models.heads_tp.HeadsTPHooks`);
``fc``, ``combine``, the norms, the MLP, the embedding and the LM head are replicated. Given the
same rows and features on every rank, every rank computes the same outputs and logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helixserve.cache_layout import ModelCaches
from helixserve.kernels._host import step_host_cache
from helixserve.models.checkpoint import CheckpointError
from helixserve.models.config import KimiModelConfig
from helixserve.models.context import ForwardBatch
from helixserve.models.heads_tp import HeadsTPHooks
from helixserve.models.helix_load import dict_readers, read_rank_param
from helixserve.models.hidden_drafter_config import HIDDEN_DRAFTER_KEY, HiddenDrafterSpec, read_hidden_drafter_config
from helixserve.models.kimi import WORLD_OF_ONE, KimiDecoderLayer, with_pending
from helixserve.models.norm import RMSNorm
from helixserve.models.packing import pack_for_cpu
from helixserve.models.sharding import check_helix_config
from helixserve.parallel import Mapping, ParallelGroups

class _Body(nn.Module):
    def __init__(self, cfg: KimiModelConfig, dtype: torch.dtype | None, mapping: Mapping) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i, dtype, mapping) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class HiddenDrafter(nn.Module):
    """The drafter of the module docstring. ``fuse`` maps target features to the feature space;
    ``forward`` runs rows (writing their MLA KV into ``caches``) and returns their outputs
    (pre-norm, the next draft row's feature); ``logits`` scores outputs. ``mapping``: a world of
    one, or one rank of the heads-TP drafter of a CP group (module docstring; needs :meth:`bind`)."""

    def __init__(self, cfg: KimiModelConfig, spec: HiddenDrafterSpec, dtype: torch.dtype | None = None,
                 mapping: Mapping = WORLD_OF_ONE) -> None:
        super().__init__()
        self.cfg, self.spec, self.mapping = cfg, spec, mapping
        self.hooks = HeadsTPHooks(cfg, mapping) if mapping.heads_tp else None
        hidden = cfg.hidden_size
        self.model = _Body(cfg, dtype, mapping)
        self.fc = nn.Linear(spec.feature_size, hidden, bias=False, dtype=dtype)
        self.feature_norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.embed_norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.combine = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.lm_head = nn.Linear(hidden, cfg.vocab_size, bias=False, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def bind(self, groups: ParallelGroups) -> HiddenDrafter:
        """Attach this rank's process groups (a heads-TP drafter's CP group all-reduces)."""
        if self.hooks is None:
            raise ValueError("a hidden drafter of one process has no groups to bind")
        self.hooks.bind(groups)
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[T, len(hidden_layers) * target_hidden]`` target features -> ``[T, hidden]``."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, batch: ForwardBatch, caches: ModelCaches, fused: torch.Tensor) -> torch.Tensor:
        """Outputs ``[T, hidden]`` of the batch's rows, ``fused`` ``[T, hidden]`` their features."""
        embeds = self.embed_norm(self.model.embed_tokens(batch.input_ids))
        x = self.combine(torch.cat([self.feature_norm(fused), embeds], dim=-1))
        pending = None
        with step_host_cache():
            for layer in self.model.layers:
                x, _, pending = layer.forward(x, None, 0, batch, caches, self.hooks, pending)
        return with_pending(x, pending)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[R, vocab]`` of outputs ``[R, hidden]``."""
        return self.lm_head(self.model.norm(hidden)).float()


def drafter_config_dict(cfg: KimiModelConfig, spec: HiddenDrafterSpec) -> dict[str, Any]:
    """The checkpoint's ``config.json`` dict."""
    return {**cfg.to_hf_dict(), HIDDEN_DRAFTER_KEY: spec.model_dump(mode="json")}


def save_hidden_drafter(model: HiddenDrafter, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (weights in ``dtype``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config_dict(model.cfg, model.spec) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().to(dtype).contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hidden_drafter(path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", mapping: Mapping = WORLD_OF_ONE) -> HiddenDrafter:
    """The drafter at ``path`` in ``dtype`` on ``device`` (:class:`CheckpointError` naming missing,
    unexpected or mis-shaped tensors), packed for inference on the CPU; with a heads-TP
    ``mapping`` this rank's heads of it (unbound: call ``bind(groups)``; a
    :class:`~helixserve.models.sharding.HelixConfigError` when its heads do not split)."""
    cfg, spec = read_hidden_drafter_config(path)
    if mapping.heads_tp:
        check_helix_config(cfg, mapping)
    with torch.device("meta"):
        full = HiddenDrafter(cfg, spec, dtype)
        model = HiddenDrafter(cfg, spec, dtype, mapping) if mapping.heads_tp else full
    tensors = load_file(str(Path(path) / "model.safetensors"))
    expected = {name: tuple(t.shape) for name, t in full.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    shapes = [f"{n} {tuple(tensors[n].shape)} (want {expected[n]})" for n in expected
              if n in tensors and tuple(tensors[n].shape) != expected[n]]
    if missing or unexpected or shapes:
        raise CheckpointError(f"hidden drafter {path}: missing {missing[:8]}, unexpected {unexpected[:8]}, "
                              f"mis-shaped {shapes[:8]}")
    if mapping.heads_tp:
        read = dict_readers(tensors)[0]
        tensors = {name: read_rank_param(name, cfg, mapping, read) for name in model.state_dict()}
    state = {n: t.to(device=device, dtype=dtype) for n, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return pack_for_cpu(model.eval().requires_grad_(False))  # type: ignore[return-value]
