"""Validated configuration: one pydantic model per role, loaded from one YAML file.

Only this module reads the environment. Roles so far: the model to load, the caches, the
single-process engine. Later roles (parallel world, transceiver, servers) add their models here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

DType = Literal["float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """Which checkpoint to serve and how to hold it."""

    path: Path
    dtype: DType | None = None  # None: the checkpoint's torch_dtype
    device: str = "cpu"
    served_name: str | None = None  # name in the API; default: the directory name

    @property
    def name(self) -> str:
        return self.served_name or self.path.name


class CacheConfig(_Strict):
    """Paged MLA cache and KDA state slots."""

    tokens_per_block: int = Field(16, ge=1, le=4096)
    memory_budget_mib: float = Field(256.0, gt=0)
    max_num_seqs: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max positions


class SchedulerConfig(_Strict):
    """Continuous batching limits."""

    max_num_batched_tokens: int = Field(2048, ge=1)


class EngineConfig(_Strict):
    """Everything a single-process engine needs."""

    model: ModelSpec
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a non-mapping document is a clear error."""
    data = yaml.safe_load(Path(path).read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data
