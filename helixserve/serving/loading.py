"""Build a worker's engine and :class:`Worker` from the deployment config."""

from __future__ import annotations

import logging
from collections.abc import Callable

from helixserve.config import DeploymentConfig
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.core import EngineCore
from helixserve.engine.llm import LLM
from helixserve.models.config import KimiModelConfig
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.protocol import KVLayout
from helixserve.serving.openai_serving import ServingLimits
from helixserve.serving.worker_app import Worker

logger = logging.getLogger(__name__)


def load_engine(deploy: DeploymentConfig) -> tuple[EngineCore, HelixTokenizer | None, KimiModelConfig]:
    """Load the checkpoint, its tokenizer and a single-process engine."""
    spec = deploy.model
    llm = LLM(spec.path, dtype=spec.dtype, device=spec.device, cache=deploy.cache,
              scheduler=deploy.scheduler, seed=deploy.seed)
    return llm.engine, llm.tokenizer, llm.model_config


def kv_layout(core: EngineCore, cfg: KimiModelConfig, served_model: str) -> KVLayout:
    """The cache layout ``core`` holds (ctx sends it; gen checks it against its own)."""
    dtype = str(core.runner.model.dtype).removeprefix("torch.")
    kda = set(cfg.kda_layer_ids)
    return KVLayout(
        model=served_model, tokens_per_block=core.layout.tokens_per_block,
        layer_kinds=["kda" if i in kda else "mla" for i in range(cfg.num_hidden_layers)],
        kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        num_kda_heads=cfg.kda_num_heads, kda_head_dim=cfg.kda_head_dim,
        conv_kernel_size=cfg.conv_kernel_size, kv_dtype=dtype, state_dtype="float32",
        conv_dtype=dtype,
    )


def make_worker(role: str, deploy: DeploymentConfig, max_queue_len: int, device: str | None = None,
                extra_gauges: Callable[[], list[tuple[str, str, float]]] | None = None) -> Worker:
    """Load the engine (on ``device``, default ``model.device``) and wrap it in an
    :class:`AsyncEngine` (started by the app's lifespan)."""
    if device is not None:
        deploy = deploy.model_copy(update={"model": deploy.model.model_copy(update={"device": device})})
    core, tokenizer, cfg = load_engine(deploy)
    engine = AsyncEngine(core, tokenizer.decode if tokenizer else None,
                         max_num_seqs=deploy.cache.max_num_seqs, max_queue_len=max_queue_len,
                         engine_thread_name=f"{role}-engine")
    limits = ServingLimits(served_model=deploy.model.name, max_model_len=core.layout.max_model_len,
                           vocab_size=cfg.vocab_size, default_max_tokens=deploy.default_max_tokens)
    worker = Worker(role, engine, tokenizer, limits, kv_layout(core, cfg, deploy.model.name))
    if extra_gauges is not None:
        worker.extra_gauges = extra_gauges
    logger.info("%s worker ready: %s, %s", role, limits, core.layout)
    return worker
