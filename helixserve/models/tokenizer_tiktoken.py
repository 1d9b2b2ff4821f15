"""The ``tiktoken`` backend: Kimi's published tokenizer format, without running its Python.

Moonshot ships ``tiktoken.model`` (one ``base64(token bytes) rank`` line per mergeable token; the
rank is the token id and the merge priority), ``tokenizer_config.json`` whose
``added_tokens_decoder`` maps ids to ``{"content", "special"}`` (Kimi's special tokens sit after
the ranks), and a ``tokenization_kimi.py`` holding the split pattern, :data:`KIMI_PAT_STR` here.
Every added token is matched where its content appears in a text (as transformers does); those
marked ``special`` are dropped by ``decode(skip_special_tokens=True)``.

Like Kimi's tokenizer, a text is encoded in pieces of at most :data:`MAX_ENCODE_CHARS` characters,
each cut so that no run of whitespace or of non-whitespace is longer than :data:`MAX_RUN_CHARS`
(the split regex backtracks over such runs).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tiktoken

from helixserve.models.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE_FILE,
    EOS_ID,
    GENERATION_CONFIG,
    NUM_BYTES,
    SPECIAL_TOKENS,
    TIKTOKEN_MODEL,
    TOKENIZER_CONFIG,
    HelixTokenizer,
    TokenizerError,
    read_json_file,
    resolve_chat_template,
    resolve_special_ids,
    template_special_tokens,
)

# Kimi's split pattern (tokenization_kimi.py's pat_str, Kimi K2 / Kimi Linear): Han runs first;
# words whose letter classes exclude Han (class intersection ``&&``), with English contractions;
# up to 3 digits; punctuation runs; newlines; whitespace not followed by a non-space; whitespace.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def read_tiktoken_model(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``'s ranks; :class:`TokenizerError` naming the line of a bad entry."""
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for num, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64-token rank'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}:{num}: bad entry {line[:80]!r} ({exc})") from exc
        if rank < 0 or rank in seen or token in ranks:
            raise TokenizerError(f"{path}:{num}: duplicate or negative rank/token {line[:80]!r}")
        ranks[token] = rank
        seen.add(rank)
    missing = [b for b in range(NUM_BYTES) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single bytes have no rank (first {missing[0]}); "
                             "every byte must be a token")
    return ranks


def added_tokens(config: dict[str, Any], config_path: Path) -> tuple[dict[str, int], set[int]]:
    """``added_tokens_decoder`` as ``({content: id}, ids marked special)``."""
    table = config.get("added_tokens_decoder") or {}
    if not isinstance(table, dict):
        raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object")
    tokens: dict[str, int] = {}
    special_ids: set[int] = set()
    for key, entry in table.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(content, str) or not content:
            raise TokenizerError(f"{config_path}: bad added_tokens_decoder entry {key!r}: {entry!r}")
        if content in tokens:
            raise TokenizerError(f"{config_path}: added token {content!r} has two ids")
        tokens[content] = int(key)
        if not isinstance(entry, dict) or entry.get("special", True):
            special_ids.add(int(key))
    return tokens, special_ids


def _bounded_runs(text: str) -> Iterator[str]:
    """``text`` cut so that no piece has more than ``MAX_RUN_CHARS`` consecutive whitespace or
    non-whitespace characters."""
    if not _LONG_RUN.search(text):
        yield text
        return
    start, run, prev_space = 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        run = run + 1 if is_space == prev_space else 1
        prev_space = is_space
        if run > MAX_RUN_CHARS:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TiktokenTokenizer(HelixTokenizer):
    """A ``tiktoken.Encoding`` (ranks + :data:`KIMI_PAT_STR` + added tokens) behind
    :class:`HelixTokenizer`."""

    def __init__(self, encoding: tiktoken.Encoding, ranks: dict[bytes, int], tokens: dict[str, int],
                 special_ids: set[int], chat_template: str, eos_token_ids: list[int],
                 bos_token_id: int | None = None, special_tokens: dict[str, str] | None = None) -> None:
        super().__init__(chat_template, eos_token_ids, bos_token_id, special_tokens)
        self.encoding = encoding
        self._ranks = ranks
        self._added = tokens
        self._special_ids = frozenset(special_ids)
        self._known_ids = frozenset(ranks.values()) | frozenset(tokens.values())
        self._max_bytes = max([len(t) for t in ranks] + [len(t.encode()) for t in tokens])

    @property
    def vocab_size(self) -> int:
        return self.encoding.max_token_value + 1

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _bounded_runs(text[i:i + MAX_ENCODE_CHARS]):
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        drop = self._special_ids if skip_special_tokens else frozenset()
        kept = [t for t in token_ids if t in self._known_ids and t not in drop]
        return self.encoding.decode_bytes(kept).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        return self._ranks.get(token.encode("utf-8"))

    def max_bytes_per_token(self) -> int | None:
        """Every input byte belongs to exactly one token (a rank's bytes, or an added token's
        content), so a text of ``n`` bytes has at least ``ceil(n / bound)`` tokens."""
        return self._max_bytes


def load_tiktoken_tokenizer(model_dir: Path) -> TiktokenTokenizer:
    """``tiktoken.model`` + ``tokenizer_config.json`` (+ ``generation_config.json``,
    ``chat_template.jinja``) from ``model_dir``."""
    ranks = read_tiktoken_model(model_dir / TIKTOKEN_MODEL)
    config_path = model_dir / TOKENIZER_CONFIG
    config = read_json_file(config_path)
    tokens, special_ids = added_tokens(config, config_path)
    clash = sorted(set(tokens.values()) & set(ranks.values()))
    if clash:
        raise TokenizerError(f"{config_path}: added token ids {clash[:8]} are also ranks in {TIKTOKEN_MODEL}")
    try:
        encoding = tiktoken.Encoding(name=f"helixserve:{model_dir.name}", pat_str=KIMI_PAT_STR,
                                     mergeable_ranks=ranks, special_tokens=tokens)
    except ValueError as exc:
        raise TokenizerError(f"{model_dir}: tiktoken refused the vocabulary ({exc})") from exc
    tok = TiktokenTokenizer(encoding, ranks, tokens, special_ids, resolve_chat_template(model_dir, config),
                            [], None, template_special_tokens(config))
    tok.bos_token_id, tok.eos_token_ids = resolve_special_ids(model_dir, config, tok.token_to_id)
    return tok


# ---------------------------------------------------------------- the tiny presets' kimi layout

# merges after the bytes and SPECIAL_TOKENS (ids 264 ...): words, a space-led word, digit groups,
# whitespace runs, and multi-byte characters whose first merge is an incomplete UTF-8 prefix
TINY_MERGES = [
    b"he", b"ll", b"llo", b"hello", b" t", b" th", b" the", b"12", b"123",
    b"  ", b"    ", b"\n\n", b"\xc3\xa9", b"\xe4\xb8", b"\xe4\xb8\xad", b"\xe6\x96", b"\xe6\x96\x87", b"\xf0\x9f",
]
TINY_MERGE_BASE = NUM_BYTES + len(SPECIAL_TOKENS)

# Kimi-style turns; a default system turn when the conversation opens without one
KIMI_TINY_CHAT_TEMPLATE = """\
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
{%- endif -%}
<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


def tiny_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(NUM_BYTES)}
    ranks.update({m: TINY_MERGE_BASE + i for i, m in enumerate(TINY_MERGES)})
    return ranks


def write_kimi_tokenizer_files(out_dir: str | Path, max_model_len: int = 1 << 20) -> None:
    """Write the published Kimi layout for the tiny vocabulary: ``tiktoken.model``,
    ``tokenizer_config.json`` (``added_tokens_decoder``), ``chat_template.jinja`` and
    ``generation_config.json``; no ``tokenizer.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(tiny_ranks().items(), key=lambda x: x[1])]
    (out / TIKTOKEN_MODEL).write_text("\n".join(lines) + "\n")
    added = {str(NUM_BYTES + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    config = {"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": added,
              "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
              "model_max_length": max_model_len}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2))
    (out / CHAT_TEMPLATE_FILE).write_text(KIMI_TINY_CHAT_TEMPLATE)
    im_end = NUM_BYTES + SPECIAL_TOKENS.index("<|im_end|>")
    (out / GENERATION_CONFIG).write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, im_end]},
                                                    indent=2))
