"""A kimi-k3-tiny checkpoint in Kimi's published layout (tiktoken.model, tokenizer_config.json,
chat_template.jinja, generation_config.json; no tokenizer.json) served router -> ctx -> gen world
(dp 1 x cp 2): its chat template and tokenizer count the prompt, its generation_config.json gives
the sampling defaults and the eos ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helixserve.models.presets import make_checkpoint
from helixserve.models.tokenizer_loader import load_tokenizer
from tests.e2e.conftest import MODEL, Deployment

GEN_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5}
MESSAGES = [{"role": "user", "content": "hello the 中文 world 12345 🙂"}]


@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory):
    out = make_checkpoint(MODEL, tmp_path_factory.mktemp("kimi") / MODEL, seed=0, tokenizer="kimi")
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **GEN_DEFAULTS}))
    return out


@pytest.fixture(scope="module")
def dep_checkpoint(kimi_ckpt) -> Path:
    return kimi_ckpt


def test_chat_and_text_prompts_use_the_published_tokenizer(dep, kimi_ckpt):
    tok = load_tokenizer(kimi_ckpt)
    client = dep.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    # chat_template.jinja adds a default system turn: our built-in template would not
    assert chat.usage.prompt_tokens == len(tok.encode_chat(MESSAGES)) > len(tok.encode(MESSAGES[0]["content"]))
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                              extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content and "\ufffd" not in text
    prompt = "hello the world 123 中文 é"
    done = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
    assert done.usage.prompt_tokens == len(tok.encode(prompt))


def test_generation_config_defaults_apply_and_request_values_win(dep):
    client = dep.client()
    prompt = "hello the world"
    default = client.completions.create(model=MODEL, prompt=prompt, seed=7, extra_body={"ignore_eos": True})
    # max_new_tokens 5 (not the deployment's default_max_tokens 16), temperature 0 (greedy)
    assert default.usage.completion_tokens == 5 and default.choices[0].finish_reason == "length"
    greedy = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert default.choices[0].text == greedy.choices[0].text
    sampled = client.completions.create(model=MODEL, prompt=prompt, temperature=2.0, top_p=1.0, seed=7,
                                        max_tokens=12, extra_body={"ignore_eos": True})
    assert sampled.usage.completion_tokens == 12
    longer_greedy = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=12,
                                              extra_body={"ignore_eos": True})
    assert sampled.choices[0].text != longer_greedy.choices[0].text


def test_generation_stops_on_the_generation_config_eos_ids(tmp_path_factory, kimi_ckpt, tmp_path):
    import shutil

    ckpt = shutil.copytree(kimi_ckpt, tmp_path / "all_eos")
    # every id is an eos id: each request stops on its first token
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(512)), **GEN_DEFAULTS}))
    d = Deployment(tmp_path_factory.mktemp("kimi_eos"), ckpt, gen={"cp": 1})  # a gen worker of one process
    try:
        client = d.start_all().client()
        done = client.completions.create(model=MODEL, prompt="hello the world", max_tokens=8)
        assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 1
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    finally:
        d.stop()
