"""Which tokenizer a checkpoint directory holds, and loading it through its backend:
``tokenizer.json`` (:mod:`~helixserve.models.tokenizer_hf`), else ``tiktoken.model``
(:mod:`~helixserve.models.tokenizer_tiktoken`, imported only then: ``tiktoken`` is optional);
``load_format: dummy``'s in-memory byte-level tokenizer. Torch-free: the router tokenizes with
it (its cache-aware policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from helixserve.models.tokenizer import (DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS, TIKTOKEN_MODEL, TOKENIZER_JSON,
                                         HelixTokenizer, TokenizerError)
from helixserve.models.tokenizer_hf import HFTokenizer, build_byte_tokenizer, load_hf_tokenizer

LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")


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


def dummy_tokenizer(model: str | Path) -> HelixTokenizer:
    """The directory's tokenizer if it has one, else the byte-level tokenizer (built in memory)."""
    found = load_tokenizer_or_none(model) if Path(model).is_dir() else None
    if found is not None:
        return found
    tok = build_byte_tokenizer()
    bos, eos = tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1])
    return HFTokenizer(tok, DEFAULT_CHAT_TEMPLATE, [eos], bos,
                       {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]})


def tokenizer_of(model: str | Path, load_format: LoadFormat = "auto") -> HelixTokenizer | None:
    """What serves ``model``: its directory's tokenizer (``None``: token ids only); ``dummy``:
    :func:`dummy_tokenizer`."""
    return dummy_tokenizer(model) if load_format == "dummy" else load_tokenizer_or_none(model)
