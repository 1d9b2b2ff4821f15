"""The speculative config: per-method requirements, vLLM's prompt-lookup defaults resolved once,
bounds on num_draft_tokens, unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from helixserve.config import GenServerConfig
from helixserve.config_speculative import SpeculativeConfig


@pytest.mark.parametrize("given,resolved", [
    ({}, (5, 5)),
    ({"prompt_lookup_max": 3}, (3, 3)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_ngram_windows_resolve_once(given, resolved):
    cfg = SpeculativeConfig(method="ngram", **given)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == resolved
    assert SpeculativeConfig.model_validate(cfg.model_dump()) == cfg  # a dump reloads as itself


@pytest.mark.parametrize("k", [1, 7])
def test_num_draft_tokens_bounds_are_inclusive(k):
    assert SpeculativeConfig(method="ngram", num_draft_tokens=k).num_draft_tokens == k


@pytest.mark.parametrize("fields,match", [
    ({"method": "ngram", "num_draft_tokens": 0}, "num_draft_tokens"),
    ({"method": "ngram", "num_draft_tokens": 8}, "num_draft_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\)"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "draft_model": "ckpt/d"}, "uses no weights"),
    ({"method": "draft"}, "needs draft_model"),
    ({"method": "hidden"}, "needs draft_model"),
    ({"method": "draft", "draft_model": "d", "prompt_lookup_max": 3}, "prompt_lookup_max is for method ngram"),
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 3}, "num_speculative_tokens"),
    ({"method": "ngram", "draft_tensor_parallel_size": 2}, "is for method draft or hidden, not 'ngram'"),
    ({"method": "draft", "draft_model": "d", "draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size"),
])
def test_bad_configs_name_the_key(fields, match):
    with pytest.raises(ValidationError, match=match):
        SpeculativeConfig(**fields)


@pytest.mark.parametrize("method", ["draft", "hidden"])
def test_a_gen_worlds_drafter_heads_split_over_1_or_cp_ranks(method):
    def spec(tp: int) -> SpeculativeConfig:
        return SpeculativeConfig(method=method, draft_model="d", draft_tensor_parallel_size=tp)

    assert SpeculativeConfig(method=method, draft_model="d").draft_tensor_parallel_size == 1
    for tp in (1, 4):
        assert GenServerConfig(dp=2, cp=4, speculative=spec(tp)).speculative.draft_tensor_parallel_size == tp
    for tp in (2, 8):
        with pytest.raises(ValidationError, match=rf"draft_tensor_parallel_size={tp} must be 1 .* or gen.cp=4"):
            GenServerConfig(dp=2, cp=4, speculative=spec(tp))


def test_draft_methods_keep_their_checkpoint():
    cfg = SpeculativeConfig(method="hidden", draft_model="ckpt/eagle", num_draft_tokens=4)
    assert cfg.draft_model == Path("ckpt/eagle") and cfg.prompt_lookup_min is None
