"""Load one rank's shard of a Kimi checkpoint into :class:`~helixserve.models.kimi.KimiForCausalLM`
built for the rank's :class:`~helixserve.parallel.Mapping` (the slices :mod:`.sharding` lays out).

A rank materializes only what it runs: its KDA heads (``[r*H/cp, (r+1)*H/cp)``: q/k/v/g/f_b rows,
conv kernels, dt_bias, A_log, b_proj rows, o_proj columns), its MLA value heads at ``cp > 1``
(``w_uv``, gate rows, o_proj columns; ``w_uk`` of every head, which the absorbed query needs; at
``cp == 1`` the whole ``kv_b_proj``) and its experts (``[rank*E/world, (rank+1)*E/world)``);
everything else (embeddings, norms, routers, shared experts, the dense MLP, the LM head) is
replicated. A world of one loads the whole model and, on the CPU, packs it like
:func:`~helixserve.models.loading.load_model` (the single-process model). A draft model's heads-TP
mapping (``mapping.heads_tp``) reads its KDA heads as above, its MLA heads' query, ``kv_b_proj`` and
gate rows and o_proj columns, every expert, and is packed like a world of one.

Checkpoints in the original tensor names (``save_checkpoint``'s output and the published
layouts, MXFP4 experts included) are read lazily: per-head rows / columns through safetensors'
``get_slice``, and only the local experts' tensors. Any other layout accepted by
:func:`~helixserve.models.loading.load_model` (transformers' in-memory names, fused conv, stacked
experts) is read whole, canonicalized and then sliced. Routed experts stay MXFP4 bytes when
``experts`` resolves to ``"packed"`` (:func:`~helixserve.models.loading.resolve_expert_format`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from helixserve.kernels.moe.mxfp4 import scale_bytes
from helixserve.models.checkpoint import (
    CheckpointError,
    ExpertFormat,
    _normalize_a_log,
    canonicalize,
    check_tensors,
    expected_shapes,
    iter_checkpoint_keys,
    read_checkpoint_tensors,
    to_internal,
)
from helixserve.models.config import KimiModelConfig
from helixserve.models.helix_hooks import MoeMode
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.loading import model_tensors, resolve_expert_format, use_mxfp4_experts
from helixserve.models.mxfp4 import dequantize_mxfp4
from helixserve.models.packing import pack_for_inference
from helixserve.models.quantization import check_checkpoint_quantization
from helixserve.parallel import Mapping

_EXPERTS_RE = re.compile(r"^(.+\.experts)\.w13(_packed|_scale)?$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|block_sparse_moe)\.(.+)$")
_KDA_ROWS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
             "v_conv1d.weight", "f_b_proj.weight", "g_proj.weight", "g_b_proj.weight", "dt_bias"}
_EXPERT_PARTS = ("w1", "w2", "w3")
# a heads-TP draft's MLA: rows per head of the projections whose rows are heads
_MLA_HEAD_ROWS: dict[str, Callable[[KimiModelConfig], int]] = {
    "q_proj.weight": lambda cfg: cfg.qk_head_dim, "q_b_proj.weight": lambda cfg: cfg.qk_head_dim,
    "kv_b_proj.weight": lambda cfg: cfg.qk_nope_head_dim + cfg.v_head_dim}

# read(name, dim, start, stop): a canonical tensor, or its [start, stop) slice along dim
Reader = Callable[[str, int | None, int, int], torch.Tensor]
# read_experts(base, experts, suffix): stacked (w13 [E_l, 2I, De], w2 [E_l, De, I]) of those experts;
# suffix "_packed" / "_scale": their MXFP4 bytes ([.., De/2] / [.., De/32] ...)
ExpertReader = Callable[[str, range, str], tuple[torch.Tensor, torch.Tensor]]


def load_helix_model(
    model_dir: str | Path, mapping: Mapping, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", moe_mode: MoeMode = "sliced", experts: ExpertFormat = "auto",
) -> KimiForCausalLM:
    """This rank's :class:`KimiForCausalLM` (unbound: call ``bind(groups)``); ``experts``: see
    :func:`~helixserve.models.loading.resolve_expert_format`.

    Raises :class:`~helixserve.models.sharding.HelixConfigError` before reading any weight when the
    model does not fit ``mapping``, and :class:`CheckpointError` for missing / mis-shaped tensors.
    """
    cfg = KimiModelConfig.from_pretrained(model_dir)
    check_checkpoint_quantization(model_dir, cfg)
    is_packed = resolve_expert_format(experts, cfg, dtype, device) == "packed"
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype, mapping, moe_mode)
        full = KimiForCausalLM(cfg, dtype)  # the checkpoint holds the unsharded shapes
    if is_packed:
        use_mxfp4_experts(model)
        use_mxfp4_experts(full)
    expected = expected_shapes(full)
    lazy = _LazyCheckpoint(Path(model_dir), cfg)
    if lazy.matches(expected):
        lazy.check_shapes(expected)
        reader, expert_reader = lazy.read, lazy.read_experts
    else:  # another accepted layout: read whole, canonicalize, check, slice in memory
        tensors = read_checkpoint_tensors(model_dir, cfg, log_skipped=False)
        canonical = canonicalize(tensors, cfg, keep_mxfp4=is_packed)
        check_tensors(canonical, expected)
        reader, expert_reader = dict_readers(to_internal(canonical, cfg))
    return materialize(model, reader, expert_reader, dtype, device)


def shard_state_dict(
    state: dict[str, torch.Tensor], cfg: KimiModelConfig, mapping: Mapping, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", moe_mode: MoeMode = "sliced",
) -> KimiForCausalLM:
    """This rank's model from a full single-process ``state_dict`` (stacked experts; tests, benches)."""
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype, mapping, moe_mode)
    reader, expert_reader = dict_readers(state)
    return materialize(model, reader, expert_reader, dtype, device)


# ---------------------------------------------------------------- which slice each parameter is


def materialize(
    model: KimiForCausalLM, read: Reader, read_experts: ExpertReader, dtype: torch.dtype,
    device: str | torch.device,
) -> KimiForCausalLM:
    cfg, mapping = model.cfg, model.mapping
    params = model_tensors(model)
    state: dict[str, torch.Tensor] = {}
    for name in params:
        if name in state:
            continue
        if m := _EXPERTS_RE.match(name):
            base, suffix = m.group(1), m.group(2) or ""
            local = mapping.local_experts(cfg.num_experts)
            state[name], state[f"{base}.w2{suffix}"] = read_experts(base, local, suffix)
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            state[name] = read("model.embed_tokens.weight", None, 0, 0)
        else:
            state[name] = read_rank_param(name, cfg, mapping, read)
    for name, p in params.items():
        value = state[name]
        if tuple(value.shape) != tuple(p.shape):
            raise CheckpointError(f"{name}: shard has shape {tuple(value.shape)}, the rank expects {tuple(p.shape)}")
        state[name] = value.to(device=device, dtype=p.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.eval().requires_grad_(False)
    return pack_for_inference(model) if mapping.world_size == 1 or mapping.heads_tp else model


def read_rank_param(name: str, cfg: KimiModelConfig, mapping: Mapping, read: Reader) -> torch.Tensor:
    """Parameter ``name`` (a canonical ``model.layers.*`` / top-level name) as the rank of
    ``mapping`` holds it, read through ``read`` (see the module docstring); a hidden drafter's
    layers read theirs through it too."""
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) != "self_attn":
        return read(name, None, 0, 0)
    layer, leaf = int(m.group(1)), m.group(3)
    prefix = f"model.layers.{layer}.self_attn."
    if cfg.is_kda_layer(layer):
        heads = mapping.local_heads(cfg.kda_num_heads)
        K = cfg.kda_head_dim
        if leaf in _KDA_ROWS:
            return read(name, 0, heads.start * K, heads.stop * K)
        if leaf in ("A_log", "b_proj.weight"):
            return read(name, 0, heads.start, heads.stop)
        if leaf == "o_proj.weight":
            return read(name, 1, heads.start * K, heads.stop * K)
        return read(name, None, 0, 0)
    heads = mapping.local_heads(cfg.num_attention_heads)
    v, nope, r = cfg.v_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if mapping.heads_tp and leaf in _MLA_HEAD_ROWS:  # a draft's heads: every per-head projection
        width = _MLA_HEAD_ROWS[leaf](cfg)
        return read(name, 0, heads.start * width, heads.stop * width)
    if leaf in ("w_uk", "w_uv"):
        kv_b = read(prefix + "kv_b_proj.weight", None, 0, 0).view(cfg.num_attention_heads, nope + v, r)
        return kv_b[:, :nope].clone() if leaf == "w_uk" else kv_b[heads.start:heads.stop, nope:].clone()
    if leaf == "g_proj.weight":
        return read(name, 0, heads.start * v, heads.stop * v)
    if leaf == "o_proj.weight":
        return read(name, 1, heads.start * v, heads.stop * v)
    return read(name, None, 0, 0)


def dict_readers(state: dict[str, torch.Tensor]) -> tuple[Reader, ExpertReader]:
    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in state:
            raise CheckpointError(f"missing tensor {name!r}")
        t = state[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    def read_experts(base: str, experts: range, suffix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = state[f"{base}.w13{suffix}"], state[f"{base}.w2{suffix}"]
        return w13[experts.start:experts.stop], w2[experts.start:experts.stop]

    return read, read_experts


# ---------------------------------------------------------------- lazy safetensors reads


class _LazyCheckpoint:
    """Canonical-name reads straight from the safetensors files of an original-name checkpoint."""

    def __init__(self, model_dir: Path, cfg: KimiModelConfig) -> None:
        self.cfg = cfg
        self._files = {}
        self._where: dict[str, tuple[Path, str]] = {
            name: (path, key) for path, _, key, name in iter_checkpoint_keys(model_dir, cfg)}

    def _names_for(self, name: str) -> list[str]:
        if name.endswith(".weight") and ".experts." in name and name not in self._where:
            return [name.removesuffix(".weight") + ".weight_packed", name.removesuffix(".weight") + ".weight_scale"]
        return [name]

    def matches(self, expected: dict[str, tuple[int, ...]]) -> bool:
        """Whether the files hold exactly the expected canonical names (MXFP4 pairs allowed)."""
        wanted = {stored for name in expected for stored in self._names_for(name)}
        return wanted == set(self._where)

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        bad = []
        for name, shape in expected.items():
            if self._names_for(name) != [name] or name.endswith(".A_log"):
                continue  # MXFP4 pairs and A_log variants are checked when read
            got = tuple(self._slice(name).get_shape())
            if got != shape:
                bad.append(f"{name}: checkpoint {got} vs model {shape}")
        if bad:
            raise CheckpointError("mis-shaped tensors: " + ", ".join(bad[:8]) + (f", ... ({len(bad)} in all)" if len(bad) > 8 else ""))

    def _slice(self, name: str):
        path, key = self._where[name]
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = safe_open(str(path), framework="pt")
        return f.get_slice(key)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r}")
        if name.endswith(".self_attn.A_log"):
            t = _normalize_a_log(name, self._slice(name)[:], self.cfg.kda_num_heads)
            return t if dim is None else t[start:stop]
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        return sl[:, start:stop]

    def _read_expert(self, name: str) -> torch.Tensor:
        if name.endswith(".weight_scale"):
            return scale_bytes(self._slice(name)[:])
        if name in self._where:
            return self._slice(name)[:]
        packed, scale = self._names_for(name)
        try:
            return dequantize_mxfp4(self._slice(packed)[:], self._slice(scale)[:])
        except ValueError as exc:
            raise CheckpointError(f"{packed!r}: {exc}") from exc

    def read_experts(self, base: str, experts: range, suffix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = [], []
        for e in experts:
            w1, w2e, w3 = (self._read_expert(f"{base}.{e}.{part}.weight{suffix}") for part in _EXPERT_PARTS)
            w13.append(torch.cat([w1, w3]))
            w2.append(w2e)
        return torch.stack(w13), torch.stack(w2)
