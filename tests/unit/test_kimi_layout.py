"""A tiny checkpoint in Kimi's published layout (``make-checkpoint --tokenizer kimi``) through the
engine: text prompts, eos ids from generation_config.json, and its sampling defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helixserve.cli import main
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.models.generation_config import GenerationDefaults, load_generation_defaults
from helixserve.models.tokenizer_tiktoken import TiktokenTokenizer
from helixserve.protocol import ChatCompletionRequest, CompletionRequest
from helixserve.serving.openai_serving import ServingLimits, sampling_params

PRESET = "kimi-linear-tiny"


@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi_layout") / PRESET
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(out), "--tokenizer", "kimi"]) == 0
    return out


def test_make_checkpoint_writes_the_published_layout(kimi_ckpt):
    names = {p.name for p in kimi_ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    assert "tokenizer.json" not in names
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--preset", PRESET, "--out", str(kimi_ckpt), "--tokenizer", "sentencepiece"])


def test_engine_encodes_text_and_stops_on_generation_config_eos(kimi_ckpt, tmp_path):
    llm = LLM(kimi_ckpt)
    assert isinstance(llm.tokenizer, TiktokenTokenizer)
    prompt = "hello the world 123 中文"
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert free.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    tokens = free.token_ids
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)
    # the same checkpoint whose generation_config.json lists tokens[k] as an eos id
    ckpt = Path(shutil.copytree(kimi_ckpt, tmp_path / "eos"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, tokens[k]]}))
    stopped = LLM(ckpt).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == tokens[:k + 1]


def _limits(defaults: GenerationDefaults, default_max_tokens: int | None = 256) -> ServingLimits:
    return ServingLimits(served_model="m", max_model_len=64, vocab_size=512,
                         default_max_tokens=default_max_tokens, max_prompt_tokens=64,
                         max_body_bytes=1 << 20, generation_defaults=defaults)


def test_generation_config_defaults_apply_where_a_request_sets_none(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "max_new_tokens": 12, "do_sample": True,
         "eos_token_id": [1, 2]}))
    defaults = load_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=40, max_tokens=12)
    limits = _limits(defaults)
    p = sampling_params(CompletionRequest(model="m", prompt=[1, 2]), 2, limits)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 40, 12)
    p = sampling_params(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]), 60, limits)
    assert p.max_tokens == 4  # the default, capped by the context left
    # explicit values win, falsy ones included
    body = CompletionRequest(model="m", prompt=[1], temperature=0.0, top_p=1.0, top_k=0, max_tokens=3)
    p = sampling_params(body, 1, limits)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 1.0, 0, 3)
    # no generation_config.json: OpenAI's defaults and the server's default_max_tokens
    p = sampling_params(CompletionRequest(model="m", prompt=[1]), 1, _limits(GenerationDefaults(), 5))
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 5)
    assert load_generation_defaults(tmp_path / "missing") == GenerationDefaults()


@pytest.mark.parametrize("raw, needle", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                         ({"max_new_tokens": 0}, "max_new_tokens"), ({"top_k": "x"}, "top_k")])
def test_bad_generation_config_names_the_field(tmp_path, raw, needle):
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"generation_config.json: {needle}="):
        load_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_generation_defaults(tmp_path)
