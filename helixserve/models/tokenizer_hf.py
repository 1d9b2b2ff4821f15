"""The HF ``tokenizers`` backend (``tokenizer.json``) and the tiny presets' byte-level tokenizer.

The byte-level tokenizer: ids 0..255 are the 256 bytes (GPT-2 byte-to-unicode alphabet, no merges,
so every UTF-8 string round-trips), followed by :data:`~helixserve.models.tokenizer.SPECIAL_TOKENS`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from helixserve.models.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    NUM_BYTES,
    SPECIAL_TOKENS,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    HelixTokenizer,
    TokenizerError,
    read_json_file,
    resolve_chat_template,
    resolve_special_ids,
    template_special_tokens,
)


class HFTokenizer(HelixTokenizer):
    """A ``tokenizers.Tokenizer`` behind :class:`HelixTokenizer`."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, eos_token_ids: list[int],
                 bos_token_id: int | None = None, special_tokens: dict[str, str] | None = None) -> None:
        super().__init__(chat_template, eos_token_ids, bos_token_id, special_tokens)
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long prompt tokenized in a worker
        # thread leaves the server's event loop running
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def max_bytes_per_token(self) -> int | None:
        """Proven for a byte-level BPE without normalizer and unknown token: every input byte is
        one character of exactly one token's string (added tokens match their content), so a text
        of ``n`` bytes has at least ``ceil(n / bound)`` tokens. (Encoding the token strings as
        UTF-8 over-counts the byte alphabet's two-byte characters: a safe, looser bound.)"""
        tok = self.tokenizer
        if (tok.normalizer is not None or not isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel)
                or not isinstance(tok.model, models.BPE) or tok.model.unk_token is not None):
            return None
        return max(len(t.encode()) for t in tok.get_vocab(with_added_tokens=True))


def load_hf_tokenizer(model_dir: Path) -> HFTokenizer:
    """``tokenizer.json`` (+ optional ``tokenizer_config.json``, ``generation_config.json``,
    ``chat_template.jinja``) from ``model_dir``."""
    tok_file = model_dir / TOKENIZER_JSON
    if not tok_file.is_file():
        raise TokenizerError(f"no {TOKENIZER_JSON} in {model_dir}")
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise TokenizerError(f"{tok_file}: {exc}") from exc
    config = read_json_file(model_dir / TOKENIZER_CONFIG)
    bos_id, eos_ids = resolve_special_ids(model_dir, config, tok.token_to_id)
    return HFTokenizer(tok, resolve_chat_template(model_dir, config), eos_ids, bos_id,
                       template_special_tokens(config))


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
    build_byte_tokenizer().save(str(out / TOKENIZER_JSON))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "chat_template": DEFAULT_CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2))
