"""Which tokenizer a checkpoint directory holds, and loading it through its backend:
``tokenizer.json`` (:mod:`~helixserve.models.tokenizer_hf`), else ``tiktoken.model``
(:mod:`~helixserve.models.tokenizer_tiktoken`, imported only then: ``tiktoken`` is optional)."""

from __future__ import annotations

from pathlib import Path

from helixserve.models.tokenizer import TIKTOKEN_MODEL, TOKENIZER_JSON, HelixTokenizer, TokenizerError
from helixserve.models.tokenizer_hf import load_hf_tokenizer


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer either backend loads."""
    path = Path(model_dir)
    return (path / TOKENIZER_JSON).is_file() or (path / TIKTOKEN_MODEL).is_file()


def load_tokenizer(model_dir: str | Path) -> HelixTokenizer:
    """The tokenizer of ``model_dir``: ``tokenizer.json`` if present, else ``tiktoken.model``."""
    path = Path(model_dir)
    if (path / TOKENIZER_JSON).is_file():
        return load_hf_tokenizer(path)
    if (path / TIKTOKEN_MODEL).is_file():
        from helixserve.models.tokenizer_tiktoken import load_tiktoken_tokenizer

        return load_tiktoken_tokenizer(path)
    raise TokenizerError(f"no {TOKENIZER_JSON} or {TIKTOKEN_MODEL} in {path}")


def load_tokenizer_or_none(model_dir: str | Path) -> HelixTokenizer | None:
    """:func:`load_tokenizer`, or None when ``model_dir`` has no tokenizer (token ids only)."""
    return load_tokenizer(model_dir) if has_tokenizer(model_dir) else None


def no_tokenizer_message(model_dir: str | Path) -> str:
    return f"{model_dir} has no {TOKENIZER_JSON} or {TIKTOKEN_MODEL}: pass token ids"
