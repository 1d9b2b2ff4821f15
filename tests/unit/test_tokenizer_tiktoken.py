"""Kimi's published tokenizer format (tiktoken.model + tokenizer_config.json + chat_template.jinja +
generation_config.json, no tokenizer.json) through the tiktoken backend."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
import regex
import tiktoken
from jinja2.exceptions import SecurityError
from tiktoken.load import load_tiktoken_bpe

from helixserve.engine.output_stream import IncrementalDetokenizer
from helixserve.models.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    EOS_ID,
    SPECIAL_TOKENS,
    TokenizerError,
)
from helixserve.models.tokenizer_loader import has_tokenizer, load_tokenizer, load_tokenizer_or_none
from helixserve.models.tokenizer_tiktoken import (
    KIMI_PAT_STR,
    MAX_RUN_CHARS,
    TINY_MERGE_BASE,
    TINY_MERGES,
    TiktokenTokenizer,
    write_kimi_tokenizer_files,
)
from helixserve.serving.openai_serving import max_bytes_per_token

IM_END_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")
TEXTS = [
    "hello", "hello the world", "Hello World HELLO", "I'm sure they'll say don't", "héllo, wörld 🙂",
    "中文abc 中文", "12345 67 8", "a  b    c\t\td", "line\n\nbreak\r\n\r\nend", "  leading and trailing  ",
    "<|im_user|>user<|im_middle|>hi<|im_end|>", "x<|eos|>y<|bos|>", "tabs\t\t\tand\n\n\n\nnewlines",
    "emoji 🙂🙂 and ünïcödé", "", "\x00\x7f\xff", "mixed中文English123中456",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kimi_tok")
    write_kimi_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def reference(kimi_dir) -> tiktoken.Encoding:
    """tiktoken itself: its own tiktoken.model reader, Kimi's pattern, the added tokens."""
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    specials = {e["content"]: int(i) for i, e in config["added_tokens_decoder"].items()}
    return tiktoken.Encoding(name="ref", pat_str=KIMI_PAT_STR,
                             mergeable_ranks=load_tiktoken_bpe(str(kimi_dir / "tiktoken.model")),
                             special_tokens=specials)


def test_layout_has_no_tokenizer_json_and_loads_the_tiktoken_backend(kimi_dir):
    assert not (kimi_dir / "tokenizer.json").exists()
    assert {p.name for p in kimi_dir.iterdir()} == {
        "tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert has_tokenizer(kimi_dir)
    assert isinstance(load_tokenizer(kimi_dir), TiktokenTokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_exactly_as_tiktoken_and_round_trips(kimi_dir, reference, text):
    tok = load_tokenizer(kimi_dir)
    ids = tok.encode(text)
    assert ids == reference.encode(text, allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_merges_and_special_tokens_are_used(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    rank = {m: TINY_MERGE_BASE + i for i, m in enumerate(TINY_MERGES)}
    assert tok.encode("hello the") == [rank[b"hello"], rank[b" the"]]
    assert tok.encode("中文") == [rank["中".encode()], rank["文".encode()]]
    assert tok.encode("12345") == [rank[b"123"], ord("4"), ord("5")]
    assert tok.encode("<|im_end|><|eos|>") == [IM_END_ID, EOS_ID]
    assert tok.decode([rank[b"hello"], EOS_ID, IM_END_ID, ord("!")]) == "hello!"  # specials skipped


def test_kimi_pattern_splits_han_letters_digits_and_spaces():
    # Han runs are their own pieces (o200k's pattern would keep "中文abc" whole); digits by 3.
    # Python's regex needs V1 for the class intersection ``&&`` that tiktoken's Rust regex reads
    pattern = regex.compile("(?V1)" + KIMI_PAT_STR)
    assert pattern.findall("中文abc") == ["中文", "abc"]
    assert pattern.findall("x 12345") == ["x", " ", "123", "45"]
    assert pattern.findall("I'm  ok\n\n") == ["I'm", " ", " ok", "\n\n"]
    assert pattern.findall("HelloWorld") == ["Hello", "World"]


def test_unknown_ids_are_dropped_and_vocab_size(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    top = TINY_MERGE_BASE + len(TINY_MERGES) - 1
    assert tok.vocab_size == top + 1
    assert tok.decode([ord("a"), top + 1, 500, ord("b")]) == "ab"


def test_incremental_detokenization_holds_back_incomplete_utf8(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    prefix = TINY_MERGE_BASE + TINY_MERGES.index(b"\xe4\xb8")  # the first two bytes of 中
    detok = IncrementalDetokenizer(tok.decode)
    assert detok.add([ord("a"), prefix], is_finished=False) == "a"
    assert detok.add([0xAD], is_finished=False) == "中"
    text = "é 🙂 中文 hello"
    detok = IncrementalDetokenizer(tok.decode)
    ids = list(text.encode())  # one byte per step: every multi-byte character arrives in pieces
    deltas = [detok.add([i], is_finished=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_chat_template_comes_from_chat_template_jinja(kimi_dir, tmp_path):
    tok = load_tokenizer(kimi_dir)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == ("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
                    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert ids[0] == 256 + SPECIAL_TOKENS.index("<|im_system|>") and ids[-1] == 256 + SPECIAL_TOKENS.index("<|im_middle|>")
    # precedence: chat_template.jinja, else tokenizer_config.json's chat_template, else ours
    write_kimi_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "<x>"
    (tmp_path / "chat_template.jinja").unlink()
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "[x]"
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).chat_template == DEFAULT_CHAT_TEMPLATE


def test_chat_template_is_sandboxed(kimi_dir, tmp_path):
    write_kimi_tokenizer_files(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_eos_and_bos_from_tokenizer_config_and_generation_config(kimi_dir, tmp_path):
    tok = load_tokenizer(kimi_dir)
    assert tok.eos_token_ids == [EOS_ID, IM_END_ID] and tok.bos_token_id == 256
    write_kimi_tokenizer_files(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 300, "bos_token_id": 7}))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["bos_token"], cfg["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == [IM_END_ID, 300] and tok.bos_token_id == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        load_tokenizer(tmp_path)


def test_max_bytes_per_token_is_a_bound(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    bound = max_bytes_per_token(tok)
    assert bound == max(len(m) for m in TINY_MERGES + [s.encode() for s in SPECIAL_TOKENS])
    rng = random.Random(0)
    alphabet = ["hello", " the", "    ", "中", "文", "123", "<|im_assistant|>", "é", "\n\n", "x"]
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert len(tok.encode(text)) >= -(-len(text.encode()) // bound)


def test_long_runs_are_cut_like_kimi(kimi_dir, reference):
    tok = load_tokenizer(kimi_dir)
    text = " " * (MAX_RUN_CHARS + 10) + "x" + "a" * (MAX_RUN_CHARS + 1)
    ids = tok.encode(text)
    first, second = text[:MAX_RUN_CHARS], text[MAX_RUN_CHARS:MAX_RUN_CHARS + 11 + MAX_RUN_CHARS]
    expected = [reference.encode(p) for p in (first, second, text[len(first) + len(second):])]
    assert ids == [i for part in expected for i in part]
    assert tok.decode(ids) == text


def _edit_model(d: Path, lines: list[str]) -> None:
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")


def test_bad_files_are_named_errors(tmp_path):
    write_kimi_tokenizer_files(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    _edit_model(tmp_path, [*lines[:3], "not-base64!! 3", *lines[4:]])
    with pytest.raises(TokenizerError, match=r"tiktoken.model:4"):
        load_tokenizer(tmp_path)
    _edit_model(tmp_path, lines[1:])  # byte 0 has no rank
    with pytest.raises(TokenizerError, match="single bytes have no rank"):
        load_tokenizer(tmp_path)
    _edit_model(tmp_path, [*lines, f"{base64.b64encode(b'zz').decode()} 5"])  # rank 5 twice
    with pytest.raises(TokenizerError, match="duplicate"):
        load_tokenizer(tmp_path)
    _edit_model(tmp_path, lines)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["100"] = {"content": "<|clash|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"\[100\] are also ranks"):
        load_tokenizer(tmp_path)


def test_no_tokenizer_files(tmp_path):
    assert not has_tokenizer(tmp_path) and load_tokenizer_or_none(tmp_path) is None
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        load_tokenizer(tmp_path)
