"""Tokenizer interface, the checkpoint files it loads from, and the chat template (a leaf of
``models``: the backends import it, :mod:`~helixserve.models.tokenizer_loader` picks one).

Two formats of a checkpoint directory load through
:func:`~helixserve.models.tokenizer_loader.load_tokenizer` into one :class:`HelixTokenizer`
interface:

- ``tokenizer.json`` (HF ``tokenizers``; :mod:`helixserve.models.tokenizer_hf`);
- ``tiktoken.model`` without ``tokenizer.json``, as Moonshot publishes Kimi models: base64 token +
  rank lines, read with the ``tiktoken`` library and Kimi's split pattern
  (:mod:`helixserve.models.tokenizer_tiktoken`). The checkpoint's own Python is never run.

Either way ``tokenizer_config.json`` (special tokens, ``bos_token`` / ``eos_token``, maybe
``chat_template``) and ``generation_config.json`` (``bos_token_id`` / ``eos_token_id``, an int or
a list) complete it. The chat template is ``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``, else :data:`DEFAULT_CHAT_TEMPLATE`; it renders in Jinja's sandbox, as
transformers renders it (``trim_blocks``, ``lstrip_blocks``).

The tiny presets' vocabulary (either format): ids 0..255 are the 256 bytes, then
:data:`SPECIAL_TOKENS` at 256..263; the ``kimi`` format adds a few merges after them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helixserve.models.generation_config import GENERATION_CONFIG, read_json_object

logger = logging.getLogger(__name__)

NUM_BYTES = 256
SPECIAL_TOKENS = [
    "<|bos|>",  # 256
    "<|eos|>",  # 257
    "<|pad|>",  # 258
    "<|im_system|>",  # 259
    "<|im_user|>",  # 260
    "<|im_assistant|>",  # 261
    "<|im_middle|>",  # 262
    "<|im_end|>",  # 263
]
TINY_VOCAB_SIZE = 512
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
IM_END = "<|im_end|>"

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Kimi-style chat format: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
CHAT_ROLES = frozenset({"system", "user", "assistant"})


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or invalid."""


class HelixTokenizer(ABC):
    """Encode/decode and chat rendering for one checkpoint (either backend)."""

    def __init__(self, chat_template: str, eos_token_ids: list[int], bos_token_id: int | None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        # bos_token / eos_token / ... strings, given to the chat template as transformers does
        self.special_tokens = dict(special_tokens or {})

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """One past the largest id this tokenizer knows."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it are their ids."""

    @abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``: incomplete UTF-8 becomes U+FFFD, unknown ids are dropped."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a whole token (a special token's content), or None."""

    @abstractmethod
    def max_bytes_per_token(self) -> int | None:
        """An upper bound on the UTF-8 bytes of input text one token covers (None: not proven)."""

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` (``role``/``content`` dicts) with the chat template."""
        for m in messages:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"unsupported chat role {m.get('role')!r}")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """``source`` compiled once in Jinja's immutable sandbox (a checkpoint's template is data)."""
    if source not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


# ---------------------------------------------------------------- checkpoint metadata


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent; :class:`TokenizerError` naming it when malformed."""
    return read_json_object(path, TokenizerError)


def token_content(value: Any) -> str | None:
    """``bos_token`` / ``eos_token`` as written in tokenizer_config.json: a string or an
    AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def resolve_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str:
    """``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``, else ours."""
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: [{"name", "template"}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else DEFAULT_CHAT_TEMPLATE


def _ids(value: Any, field: str, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: {field} must be a token id or a list of them, got {value!r}")
    return list(values)


def resolve_special_ids(model_dir: Path, tokenizer_config: dict[str, Any],
                        token_to_id: Callable[[str], int | None]) -> tuple[int | None, list[int]]:
    """``(bos id, eos ids)`` from tokenizer_config.json's ``bos_token`` / ``eos_token`` and
    generation_config.json's ``bos_token_id`` / ``eos_token_id``; ``<|im_end|>`` (the end of an
    assistant turn) is an eos id wherever the vocabulary has it."""
    gen_path = model_dir / GENERATION_CONFIG
    gen = read_json_file(gen_path)
    eos_ids: list[int] = []
    for name in (token_content(tokenizer_config.get("eos_token")), IM_END):
        tid = token_to_id(name) if name else None
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    for tid in _ids(gen.get("eos_token_id"), "eos_token_id", gen_path):
        if tid not in eos_ids:
            eos_ids.append(tid)
    bos_name = token_content(tokenizer_config.get("bos_token"))
    bos_id = token_to_id(bos_name) if bos_name else None
    gen_bos = _ids(gen.get("bos_token_id"), "bos_token_id", gen_path)
    if bos_id is None and gen_bos:
        bos_id = gen_bos[0]
    return bos_id, eos_ids


def template_special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` strings for the template."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = token_content(tokenizer_config.get(key))
        if content is not None:
            out[key] = content
    return out
