"""Build a worker's engine and :class:`Worker` from the deployment config."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from helixserve.config import DeploymentConfig, SpeculativeConfig
from helixserve.dtypes import dtype_name
from helixserve.engine.async_engine import AsyncEngine, EngineCoreLike
from helixserve.engine.core import EngineCore
from helixserve.engine.llm import LLM
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.kvcache.prefix_manager import PrefixCachingCacheManager
from helixserve.models.config import KimiModelConfig
from helixserve.models.generation_config import load_generation_defaults
from helixserve.models.hidden_drafter_config import read_hidden_drafter_config
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.protocol import KVLayout
from helixserve.protocol.disagg import DraftLayout
from helixserve.serving.openai_serving import ServingLimits, max_bytes_per_token
from helixserve.serving.prefix_metrics import PrefixCacheCollector
from helixserve.serving.worker_app import Worker
from helixserve.transceiver.layout import layout_for

logger = logging.getLogger(__name__)


def load_engine(deploy: DeploymentConfig, speculative: SpeculativeConfig | None = None
                ) -> tuple[WorldDriver, HelixTokenizer | None, KimiModelConfig]:
    """Load the checkpoint, its tokenizer and a single-process engine, under its driver (a world
    of one: the engine loop of every role runs the one driver); ``speculative``: its speculative
    decoding, the worker's ``speculative`` key."""
    spec = deploy.model
    llm = LLM(spec.path, dtype=spec.dtype, device=spec.device, cache=deploy.cache,
              scheduler=deploy.scheduler, seed=deploy.seed, experts=spec.experts,
              enforce_eager=spec.enforce_eager, load_format=spec.load_format,
              deterministic=spec.deterministic, speculative=speculative)
    return llm.driver, llm.tokenizer, llm.model_config


def drafter_prompt_layout(speculative: SpeculativeConfig | None, dtype: torch.dtype) -> DraftLayout | None:
    """The prompt cache of the ``hidden`` method's drafter as it travels from a ctx worker to a gen
    CP group's leader (``KVLayout.draft``; ``None``: another method, or none), at the target's
    ``dtype``: its MLA layers' pages and one row of target features."""
    if speculative is None or speculative.method != "hidden":
        return None
    assert speculative.draft_model is not None
    cfg, spec = read_hidden_drafter_config(speculative.draft_model)
    return DraftLayout(model=Path(speculative.draft_model).name, num_layers=len(cfg.mla_layer_ids),
                       kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                       feature_size=spec.feature_size, kv_dtype=dtype_name(dtype))


def kv_layout(core: EngineCore, cfg: KimiModelConfig, served_model: str,
              speculative: SpeculativeConfig | None = None) -> KVLayout:
    """The cache layout ``core`` holds (ctx sends it; gen checks it against its own): the one
    builder, :func:`~helixserve.transceiver.layout.layout_for`, on the engine's model dtype; with
    ``speculative`` the prompt cache of its hidden drafter too."""
    dtype = core.runner.model.dtype
    return layout_for(cfg, dtype, core.layout.tokens_per_block, served_model, drafter_prompt_layout(speculative, dtype))


def make_worker(role: str, deploy: DeploymentConfig, max_queue_len: int, device: str | None = None,
                speculative: SpeculativeConfig | None = None) -> tuple[Worker, EngineCore]:
    """Load a single-process engine (on ``device``, default ``model.device``; ``speculative``:
    its speculative decoding, whose counters the worker exports) and wrap it in a
    :class:`Worker` (its :class:`AsyncEngine` is started by the app's lifespan); the core is
    returned too (its caches are what a ctx worker's KV sender reads)."""
    if device is not None:
        deploy = deploy.model_copy(update={"model": deploy.model.model_copy(update={"device": device})})
    driver, tokenizer, cfg = load_engine(deploy, speculative)
    core = driver.core
    worker = wrap_core(role, deploy, driver, tokenizer, cfg, kv_layout(core, cfg, deploy.model.name, speculative),
                       core.layout.max_model_len, max_queue_len)
    if speculative is not None:
        worker.export_spec_decode(lambda: driver.spec_stats)
    if isinstance(core.cache_manager, PrefixCachingCacheManager):
        worker.registry.register(PrefixCacheCollector(core.cache_manager.snapshot, {"role": role}))
    logger.info("%s worker ready: %s", role, core.layout)
    return worker, core


def wrap_core(role: str, deploy: DeploymentConfig, core: EngineCoreLike, tokenizer: HelixTokenizer | None,
              cfg: KimiModelConfig, layout: KVLayout, max_model_len: int, max_queue_len: int,
              num_running_slots: int | None = None) -> Worker:
    """A :class:`Worker` over any engine core (a single-process ``EngineCore`` or a gen world's
    rank-0 driver) holding ``layout`` and serving prompts up to ``max_model_len`` tokens;
    ``num_running_slots`` (default ``cache.max_num_seqs``; a world: one set per DP group)."""
    engine = AsyncEngine(core, tokenizer.decode if tokenizer else None,
                         max_num_seqs=num_running_slots or deploy.cache.max_num_seqs,
                         max_queue_len=max_queue_len,
                         engine_thread_name=f"{role}-engine")
    max_prompt_tokens = min(deploy.limits.max_prompt_tokens or max_model_len, max_model_len)
    limits = ServingLimits(served_model=deploy.model.name, max_model_len=max_model_len,
                           vocab_size=cfg.vocab_size, default_max_tokens=deploy.default_max_tokens,
                           max_prompt_tokens=max_prompt_tokens,
                           max_body_bytes=deploy.limits.max_body_bytes,
                           max_bytes_per_token=max_bytes_per_token(tokenizer),
                           generation_defaults=load_generation_defaults(deploy.model.path))
    logger.info("%s worker limits: %s", role, limits)
    return Worker(role, engine, tokenizer, limits, layout, security=deploy.security,
                  shutdown=deploy.shutdown)
