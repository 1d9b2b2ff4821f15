"""``load_format: dummy`` (vLLM's name): seeded random weights at a model's real shapes, made on the
target device, with no checkpoint on disk.

The model's config comes from ``config.json`` when ``model`` is a checkpoint directory (its weight
files are not read), else from the preset ``model`` names (the last path component, so an absolute
path that a launcher made of a preset name still names it). The tokenizer is the directory's, or
the byte-level tokenizer of the tiny presets (ids 0..255 bytes, then the special tokens: valid ids
of every preset's vocabulary).

Each tensor is drawn on the device from a generator seeded by ``(seed, its name)`` (each routed
expert by its index too) with :func:`~helixserve.models.presets.random_value`'s scales: one
generator call per tensor, no copy through the host. A rank of a larger world reads its slices of
the same full tensors (:func:`~helixserve.models.helix_load.materialize`), so a world and a single
process hold the same weights. MXFP4 stacks get uniform random FP4 codes and one e8m0 scale per
tensor chosen for ``1 / sqrt(fan_in)`` values.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch

from helixserve.models.checkpoint import ExpertFormat
from helixserve.models.loading import model_tensors, resolve_expert_format, use_mxfp4_experts
from helixserve.models.config import KimiModelConfig
from helixserve.models.helix_hooks import MoeMode
from helixserve.models.helix_load import materialize
from helixserve.models.kimi import WORLD_OF_ONE, KimiForCausalLM
from helixserve.models.presets import PRESETS, get_preset, random_value
# re-exported: where the engine and the workers have always found them
from helixserve.models.tokenizer_loader import LOAD_FORMATS, LoadFormat, dummy_tokenizer, tokenizer_of  # noqa: F401
from helixserve.parallel import Mapping

# root-mean-square of a uniformly random e2m1 code: sqrt(mean of {0, .5, 1, 1.5, 2, 3, 4, 6}^2)
_E2M1_RMS = math.sqrt(68.5 / 8)


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {list(LOAD_FORMATS)}")


def is_checkpoint_dir(model: str | Path) -> bool:
    return (Path(model) / "config.json").is_file()


def model_config_of(model: str | Path, load_format: LoadFormat = "auto") -> KimiModelConfig:
    """The config of a checkpoint directory, or (``dummy`` only) of the preset ``model`` names."""
    check_load_format(load_format)
    if is_checkpoint_dir(model):
        return KimiModelConfig.from_pretrained(model)
    if load_format != "dummy":
        raise FileNotFoundError(f"no config.json in {model}")
    name = Path(model).name
    if name not in PRESETS:
        raise ValueError(f"load_format dummy: {str(model)!r} is neither a checkpoint directory (config.json) "
                         f"nor a preset; presets: {sorted(PRESETS)}")
    return get_preset(name)


def load_dummy_model(
    cfg: KimiModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    mapping: Mapping = WORLD_OF_ONE, moe_mode: MoeMode = "sliced", experts: ExpertFormat = "auto", seed: int = 0,
) -> KimiForCausalLM:
    """This rank's :class:`KimiForCausalLM` with dummy weights (unbound in a world > 1; packed for
    the CPU at a world of one, as a loaded checkpoint is)."""
    device = torch.device(device)
    is_packed = resolve_expert_format(experts, cfg, dtype, device) == "packed"
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype, mapping, moe_mode)
        full = KimiForCausalLM(cfg, dtype)
    if is_packed:
        use_mxfp4_experts(model)
        use_mxfp4_experts(full)
    shapes = {name: tuple(t.shape) for name, t in model_tensors(full).items()}
    draw = _Draw(shapes, dtype, device, seed)
    return materialize(model, draw.read, draw.read_experts, dtype, device)


class _Draw:
    """The readers :func:`materialize` takes, drawing each tensor instead of reading it."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                 seed: int) -> None:
        self.shapes, self.dtype, self.device, self.seed = shapes, dtype, device, seed
        self.gen = torch.Generator(device=device)

    def _seeded(self, name: str, index: int = 0) -> torch.Generator:
        # the CPU generator keeps 32 bits of a seed: the seed goes into the hashed text
        return self.gen.manual_seed(zlib.crc32(f"{self.seed}:{name}#{index}".encode()))

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"the model has no tensor {name!r}")
        value = random_value(name, self.shapes[name], self._seeded(name))
        return value if dim is None else value.narrow(dim, start, stop - start)

    def read_experts(self, base: str, experts: range, suffix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        return self._stack(f"{base}.w13{suffix}", experts), self._stack(f"{base}.w2{suffix}", experts)

    def _stack(self, name: str, experts: range) -> torch.Tensor:
        _, rows, cols = self.shapes[name]
        if name.endswith("_scale"):  # one e8m0 exponent for 1/sqrt(fan_in) values: fan_in = 32 * cols
            exponent = round(math.log2(1.0 / (_E2M1_RMS * math.sqrt(32 * cols))))
            return torch.full((len(experts), rows, cols), 127 + exponent, dtype=torch.uint8, device=self.device)
        is_packed = name.endswith("_packed")
        out = torch.empty(len(experts), rows, cols, dtype=torch.uint8 if is_packed else self.dtype,
                          device=self.device)
        for i, e in enumerate(experts):
            gen = self._seeded(name, e)
            if is_packed:
                out[i].random_(0, 256, generator=gen)
            else:
                out[i].normal_(0.0, 1.0 / math.sqrt(cols), generator=gen)
        return out
