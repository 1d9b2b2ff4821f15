"""Python API: ``LLM(model_dir).generate(prompts, params)``: the engine of one process, driven
by the one engine driver (:class:`~helixserve.engine.spmd.driver.WorldDriver`, a world of one)
through the one offline loop (:func:`~helixserve.engine.spmd.driver.drive_to_completion`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.dtypes import MODEL_DTYPES, torch_dtype
from helixserve.engine.core import EngineCore
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import GenerationResult, WorldDriver, drive_to_completion
from helixserve.kernels.triton_common import set_batch_invariant
from helixserve.models.checkpoint import ExpertFormat
from helixserve.models.loading import load_model
from helixserve.models.dummy import LoadFormat, dummy_tokenizer, load_dummy_model, model_config_of
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.models.tokenizer_loader import load_tokenizer_or_none, no_tokenizer_message

__all__ = ["LLM", "GenerationError", "GenerationResult", "resolve_dtype"]


class GenerationError(RuntimeError):
    """The engine failed some requests of a ``generate`` call (a failed step); ``results`` holds
    every prompt's result, the failed ones with ``finish_reason == "error"`` and their ``error``.
    The engine stays usable."""

    def __init__(self, results: list[GenerationResult]) -> None:
        failed = [r for r in results if r.finish_reason == "error"]
        causes = "; ".join(dict.fromkeys(f"{r.error}" for r in failed))
        super().__init__(f"{len(failed)} of {len(results)} requests failed "
                         f"({', '.join(r.request_id for r in failed)}): {causes}")
        self.results = results


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` means float32 on CPU and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(dtype, MODEL_DTYPES)


class LLM:
    """Offline generation over the engine core, with continuous batching across prompts."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        cache: CacheConfig = CacheConfig(),
        scheduler: SchedulerConfig = SchedulerConfig(),
        seed: int = 0,
        experts: ExpertFormat = "auto",
        enforce_eager: bool = False,
        load_format: LoadFormat = "auto",
        deterministic: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``enforce_eager``: capture no decode CUDA graphs (``model.enforce_eager``);
        ``load_format="dummy"``: random weights (seeded by ``seed``) at the shapes of ``model_dir``'s
        config or of the preset it names (:mod:`helixserve.models.dummy`); ``deterministic``: the
        process's kernels batch-invariant from now on (``model.deterministic``); ``speculative``:
        draft and verify tokens each step (:mod:`helixserve.engine.spec`)."""
        if deterministic:
            set_batch_invariant(True)
        self.model_dir = Path(model_dir)
        dev = torch.device(device)
        self.model_config = model_config_of(self.model_dir, load_format)
        torch_dtype = resolve_dtype(dtype, dev)
        if load_format == "dummy":
            self.tokenizer: HelixTokenizer | None = dummy_tokenizer(self.model_dir)
            model = load_dummy_model(self.model_config, torch_dtype, dev, experts=experts, seed=seed)
        else:
            self.tokenizer = load_tokenizer_or_none(self.model_dir)
            model = load_model(self.model_dir, dtype=torch_dtype, device=dev, experts=experts)
        self.engine = EngineCore(model, self.model_config, self.tokenizer, cache, scheduler, dev, seed,
                                 use_cuda_graphs=not enforce_eager, speculative=speculative)
        self.driver = WorldDriver(self.engine)
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(no_tokenizer_message(self.model_dir))
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids); results in prompt order.

        Raises ``ValueError`` for a prompt that could never run (nothing runs then) and
        :class:`GenerationError` when the engine failed some of them (the others ran to the end).
        """
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        prompt_ids = [self.encode(prompt) for prompt in prompts]
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        results = drive_to_completion(self.driver, prompt_ids, params_list, self.tokenizer, ids)
        if any(r.finish_reason == "error" for r in results):
            raise GenerationError(results)
        return results
