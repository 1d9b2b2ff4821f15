"""A checkpoint's ``generation_config.json`` sampling defaults, for requests that set none.

Read once at start-up. ``temperature``, ``top_p``, ``top_k`` and ``max_new_tokens`` (the request's
``max_tokens``) are taken, as vLLM takes them; ``do_sample`` and ``max_length`` are not (an OpenAI
request samples at its temperature; the context limit is the server's). A request's explicit
value always wins; a field the file does not set leaves the server's default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

GENERATION_CONFIG = "generation_config.json"


class GenerationDefaults(BaseModel):
    """Sampling defaults of one model (None: the server's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # the engine's bounds (SamplingParams)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any], source: str = GENERATION_CONFIG) -> GenerationDefaults:
        fields = {"temperature": raw.get("temperature"), "top_p": raw.get("top_p"),
                  "top_k": raw.get("top_k"), "max_tokens": raw.get("max_new_tokens")}
        try:
            return cls.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            bad = "; ".join(f"{'max_new_tokens' if e['loc'][0] == 'max_tokens' else e['loc'][0]}="
                            f"{e.get('input')!r}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{source}: {bad}") from exc


def read_json_object(path: Path, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent; ``error`` naming the file when it is malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    """``model_dir``'s ``generation_config.json`` defaults; none when the file is absent."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults()
    return GenerationDefaults.from_generation_config(read_json_object(path), str(path))
