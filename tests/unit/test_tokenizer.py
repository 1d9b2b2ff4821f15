"""Byte-level tokenizer files and the chat template."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from helixserve.models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TokenizerError,
)
from helixserve.models.tokenizer_hf import write_tokenizer_files
from helixserve.models.tokenizer_loader import load_tokenizer

TEXTS = ["hello", "héllo, wörld 🙂", " leading space\nand\ttabs", "", "\x00\x7f\xff"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_utf8(tok_dir, text):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # one id per byte, id == byte value
    assert tok.decode(ids) == text


def test_special_token_ids_and_eos(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.encode("<|bos|><|eos|><|pad|>") == [BOS_ID, EOS_ID, PAD_ID]
    assert tok.eos_token_ids == [EOS_ID, tok.tokenizer.token_to_id("<|im_end|>")]


def test_transformers_loads_the_same_files(tok_dir):
    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    ours = load_tokenizer(tok_dir)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hf_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "input_ids"):
        hf_ids = hf_ids["input_ids"]
    assert list(hf_ids) == ours.encode_chat(messages)


def test_chat_template_renders_roles(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    with pytest.raises(ValueError, match="tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])


def test_custom_chat_template_from_config(tmp_path):
    write_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    write_tokenizer_files(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}\n  ({{ m['content'] }})\n{% endfor %}")  # trim/lstrip blocks as transformers
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "  (x)\n"
