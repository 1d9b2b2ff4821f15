"""Tokenizer: HF ``tokenizers`` files in a checkpoint directory, plus a chat template.

The tiny presets ship a byte-level tokenizer: ids 0..255 are the 256 bytes (GPT-2 byte-to-unicode
alphabet, no merges, so every UTF-8 string round-trips), followed by special tokens. Any checkpoint
directory with a ``tokenizer.json`` loads through :func:`load_tokenizer`; its chat template comes
from ``tokenizer_config.json`` (``chat_template``, Jinja) when present, else the Kimi-style default
below.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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

# Kimi-style chat format: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or invalid."""


def _byte_alphabet() -> list[str]:
    """The GPT-2 byte -> printable unicode mapping, indexed by byte value.

    Printable Latin-1 bytes map to themselves; the others map to code points 256, 257, ... in
    byte order. This is the alphabet ``pre_tokenizers.ByteLevel`` emits.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, extra = [], 0
    for b in range(NUM_BYTES):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(NUM_BYTES + extra))
            extra += 1
    return alphabet


def build_byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: ids 0..255 are bytes, then :data:`SPECIAL_TOKENS`."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_tokenizer_files(out_dir: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the byte-level tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "chat_template": DEFAULT_CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@dataclass
class HelixTokenizer:
    """Encode/decode and chat rendering for one checkpoint."""

    tokenizer: Tokenizer
    chat_template: str
    eos_token_ids: list[int]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long prompt tokenized in a worker
        # thread leaves the server's event loop running
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` (``role``/``content`` dicts) with the chat template."""
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        for m in messages:
            if m.get("role") not in {"system", "user", "assistant"}:
                raise ValueError(f"unsupported chat role {m.get('role')!r}")
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))


def load_tokenizer(model_dir: str | Path) -> HelixTokenizer:
    """Load ``tokenizer.json`` (+ optional ``tokenizer_config.json``) from ``model_dir``."""
    path = Path(model_dir)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise TokenizerError(f"no tokenizer.json in {path}")
    tok = Tokenizer.from_file(str(tok_file))
    config: dict[str, Any] = {}
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        config = json.loads(cfg_file.read_text())
    template = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
    eos_ids = []
    for name in (config.get("eos_token"), IM_END):
        if isinstance(name, dict):
            name = name.get("content")
        tid = tok.token_to_id(name) if isinstance(name, str) else None
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    return HelixTokenizer(tokenizer=tok, chat_template=template, eos_token_ids=eos_ids)
