"""A checkpoint's ``quantization_config`` (compressed-tensors), checked against its tensors.

Kimi K3 publishes its routed experts as compressed-tensors MXFP4: ``config_groups`` whose
``weights`` are 4-bit ``float`` with ``group_size`` 32 (one e8m0 scale per 32 inputs, see
:mod:`helixserve.models.mxfp4`), ``targets`` naming the quantized modules, ``ignore`` the ones
left out. A target or ignore entry is ``re:<regex>`` (matched from the start of the module name),
an exact module name, or a layer class (``Linear``). Module names are tried with and without K3's
``language_model.`` prefix.

Checked before any weight is read: every group is MXFP4 (else :class:`CheckpointError` naming the
group and the value); every module with ``weight_packed`` is listed (targeted, not ignored) and
has its ``weight_scale``; every module a ``re:`` or name target lists has ``weight_packed``, and
with a class target so does every routed expert that is not ignored (which other weights are
``Linear`` layers the tensor names alone do not tell).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.models.checkpoint import CheckpointError, iter_checkpoint_keys
from helixserve.models.config import KimiModelConfig
from helixserve.models.mxfp4 import MXFP4_GROUP_SIZE

QUANT_METHOD = "compressed-tensors"
_ROUTED_EXPERT_RE = re.compile(r"(^|\.)block_sparse_moe\.experts\.\d+\.w[123]$")


@dataclass(frozen=True, slots=True)
class QuantizedGroup:
    name: str
    targets: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QuantizationScheme:
    """What ``quantization_config`` says is MXFP4."""

    groups: tuple[QuantizedGroup, ...]
    ignore: tuple[str, ...]

    def group_of(self, module: str, prefix: str) -> QuantizedGroup | None:
        """The group quantizing ``module`` (a class target counts as matching), or None."""
        names = _names(module, prefix)
        if any(_matches(entry, names, class_matches=False) for entry in self.ignore):
            return None
        return next((g for g in self.groups if any(_matches(t, names, True) for t in g.targets)), None)

    def lists_explicitly(self, module: str, prefix: str) -> bool:
        """Whether a ``re:`` or name target (not a class) lists ``module``."""
        group = self.group_of(module, prefix)
        return group is not None and any(_matches(t, _names(module, prefix), False) for t in group.targets)


def _names(module: str, prefix: str) -> tuple[str, ...]:
    return (module, module.removeprefix(prefix)) if prefix and module.startswith(prefix) else (module,)


def _is_class_name(entry: str) -> bool:
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def _matches(entry: str, names: tuple[str, ...], class_matches: bool) -> bool:
    if entry.startswith("re:"):
        return any(re.match(entry[3:], n) for n in names)
    if _is_class_name(entry):
        return class_matches
    return entry in names


def parse_quantization_config(raw: Any) -> QuantizationScheme | None:
    """The MXFP4 scheme of a ``quantization_config`` (None: the checkpoint is not quantized)."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in (QUANT_METHOD, "mxfp4"):
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported "
                                      f"(only {QUANT_METHOD!r} MXFP4)")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config has no config_groups")
    parsed = []
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        want = {"num_bits": 4, "type": "float", "group_size": MXFP4_GROUP_SIZE}
        for key, value in want.items():
            if weights.get(key) != value:
                raise CheckpointError(
                    f"quantization_config.config_groups.{name}.weights.{key} is {weights.get(key)!r}; "
                    f"only MXFP4 ({key} {value!r}) is supported")
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise CheckpointError(f"quantization_config.config_groups.{name}.targets must be a "
                                          f"non-empty list of strings, got {targets!r}")
        parsed.append(QuantizedGroup(name, tuple(targets)))
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise CheckpointError(f"quantization_config.ignore must be a list of strings, got {ignore!r}")
    return QuantizationScheme(tuple(parsed), tuple(ignore))


def check_checkpoint_quantization(model_dir: str | Path, cfg: KimiModelConfig) -> None:
    """:func:`check_quantized_tensors` for ``model_dir`` (its tensor names only; no weight is read)."""
    scheme = parse_quantization_config(raw_quantization_config(Path(model_dir)))
    keys = [key for _, _, key, _ in iter_checkpoint_keys(model_dir, cfg, log_skipped=False)]
    check_quantized_tensors(scheme, keys, cfg.weight_prefix)


def raw_quantization_config(model_dir: Path) -> Any:
    """``quantization_config`` of ``config.json`` (top level, or K3's ``text_config``)."""
    raw = json.loads((model_dir / "config.json").read_text())
    return raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")


def check_quantized_tensors(scheme: QuantizationScheme | None, keys: Iterable[str], prefix: str) -> None:
    """Raise :class:`CheckpointError` naming the first modules whose stored tensors
    disagree with ``scheme`` (``keys``: every stored tensor name)."""
    packed, scales, dense = set(), set(), set()
    for key in keys:
        for suffix, bucket in ((".weight_packed", packed), (".weight_scale", scales), (".weight", dense)):
            if key.endswith(suffix):
                bucket.add(key.removesuffix(suffix))
                break
    problems: list[str] = []
    for module in sorted(packed):
        if scheme is None or scheme.group_of(module, prefix) is None:
            problems.append(f"{module} has weight_packed but quantization_config does not list it")
        elif module not in scales:
            problems.append(f"missing tensor {module}.weight_scale (MXFP4 scale for {module}.weight_packed)")
    if scheme is not None:
        for module in sorted(dense - packed):
            if scheme.group_of(module, prefix) is None:
                continue
            if scheme.lists_explicitly(module, prefix) or _ROUTED_EXPERT_RE.search(module):
                problems.append(f"{module} is listed as quantized (MXFP4) but has no weight_packed "
                                f"(found {module}.weight)")
    if problems:
        shown = "; ".join(problems[:4]) + (f"; ... ({len(problems)} in all)" if len(problems) > 4 else "")
        raise CheckpointError(shown)
