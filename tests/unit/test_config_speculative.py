"""The speculative config: per-method requirements, vLLM's prompt-lookup defaults resolved once,
bounds on num_draft_tokens, unknown keys refused; prefix caching (on by default) resolved once
beside a draft model: off when left unset, a named error when set true."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from helixserve.config import CacheConfig, DeploymentConfig
from helixserve.config_speculative import SpeculativeConfig

DRAFT = {"method": "draft", "draft_model": "ckpt/d"}
NGRAM = {"method": "ngram"}


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
])
def test_bad_configs_name_the_key(fields, match):
    with pytest.raises(ValidationError, match=match):
        SpeculativeConfig(**fields)


def test_draft_methods_keep_their_checkpoint():
    cfg = SpeculativeConfig(method="hidden", draft_model="ckpt/eagle", num_draft_tokens=4)
    assert cfg.draft_model == Path("ckpt/eagle") and cfg.prompt_lookup_min is None


def _deploy(cache: dict | None = None, ctx_spec: dict | None = None, gen_spec: dict | None = None,
            **extra) -> DeploymentConfig:
    gen = {"kv_source": "recompute", "dp": 1, "cp": 1, "speculative": gen_spec}
    return DeploymentConfig.model_validate({"model": {"path": "ckpt/t"}, "cache": cache or {},
                                            "ctx": [{"speculative": ctx_spec}], "gen": [gen], **extra})


def test_prefix_caching_is_on_by_default_in_every_role():
    assert CacheConfig().prefix_caching
    deploy = _deploy()
    assert deploy.cache.prefix_caching and deploy.engine.cache.prefix_caching
    assert _deploy(ctx_spec=NGRAM, gen_spec=NGRAM).cache.prefix_caching  # n-gram drafts keep it


@pytest.mark.parametrize("ctx_spec,gen_spec", [(DRAFT, None), (None, DRAFT), (DRAFT, NGRAM)])
def test_unset_prefix_caching_resolves_to_off_beside_a_draft_model_logged_once(ctx_spec, gen_spec, caplog):
    with caplog.at_level(logging.INFO, logger="helixserve.config"):
        deploy = _deploy(cache={"memory_budget_mib": 64.0}, ctx_spec=ctx_spec, gen_spec=gen_spec)
    assert not deploy.cache.prefix_caching and deploy.cache.memory_budget_mib == 64.0
    assert [r.levelno for r in caplog.records if "prefix_caching" in r.message] == [logging.INFO]
    assert "method 'draft'" in caplog.records[0].message
    reloaded = DeploymentConfig.model_validate(deploy.model_dump(mode="json"))  # a dump reloads as itself
    assert reloaded.cache == deploy.cache


def test_explicit_prefix_caching_with_a_draft_model_is_a_named_error():
    with pytest.raises(ValidationError, match="cache.prefix_caching: true does not run with speculative.method 'draft'"):
        _deploy(cache={"prefix_caching": True}, ctx_spec=DRAFT)
    with pytest.raises(ValueError, match="the LLM's engine"):
        CacheConfig(prefix_caching=True).for_speculative([SpeculativeConfig(**DRAFT)], "the LLM's engine")
    assert not _deploy(cache={"prefix_caching": False}, ctx_spec=DRAFT).cache.prefix_caching


def test_cache_aware_routing_beside_a_draft_model_names_why_caching_is_off():
    with pytest.raises(ValidationError, match="cache_aware .* resolved off beside a speculative method 'draft'"):
        _deploy(ctx_spec=DRAFT, router={"policy": "cache_aware"})
    assert _deploy(router={"policy": "cache_aware"}).cache.prefix_caching
