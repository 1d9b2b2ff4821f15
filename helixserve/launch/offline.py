"""Offline generation on a local helix_a2a world (``helixserve generate --dp --cp``): spawn
dp x cp local processes (gloo on CPU; NCCL, one GPU per rank, when enough GPUs are present) with
:func:`~helixserve.launch.processes.run_local_world`, run the prompts through rank 0's
:class:`~helixserve.engine.spmd.driver.WorldDriver`, return results like ``LLM.generate``'s. What
each rank runs is the engine's (:mod:`helixserve.engine.world_rank`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from helixserve.config import SpeculativeConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import GenerationResult, WorldDriver, drive_to_completion
from helixserve.engine.world_rank import (WorldOptions, build_rank, check_fits_world,
                                          pick_backend, serve_rank)
from helixserve.launch.processes import run_local_world
from helixserve.models.dummy import LoadFormat, model_config_of, tokenizer_of
from helixserve.models.tokenizer_loader import no_tokenizer_message
from helixserve.parallel import Mapping, init_parallel


def _world_main(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                prompts: list[list[int]], params: list[SamplingParams], options: WorldOptions) -> list[GenerationResult] | int:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend=pick_backend(world_size, options.backend),
                           local_rank=rank, timeout_s=options.timeout_s)
    try:
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            return serve_rank(part)
        assert isinstance(part, EngineCore)
        driver = WorldDriver(part)
        try:
            return drive_to_completion(driver, prompts, params, tokenizer_of(model_dir, options.load_format))
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def generate_many_on_world(model_dir: str | Path, prompts: Sequence[str | list[int]],
                           params: SamplingParams | Sequence[SamplingParams], *, dp: int, cp: int,
                           options: WorldOptions = WorldOptions()) -> list[GenerationResult]:
    """Run every prompt on a fresh local dp x cp world (bounded by ``options.run_timeout_s``);
    results in prompt order."""
    model_dir = Path(model_dir)
    cfg = model_config_of(model_dir, options.load_format)
    if dp < 1 or cp < 1:
        raise ValueError(f"dp={dp} and cp={cp} must be >= 1")
    tokenizer = tokenizer_of(model_dir, options.load_format)
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(no_tokenizer_message(model_dir))
            prompt = tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        encoded.append(list(prompt))
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
    check_fits_world(cfg, dp, cp)
    results = run_local_world(_world_main, dp * cp, str(model_dir), dp, cp, encoded, params_list, options,
                              timeout_s=options.run_timeout_s, grace_s=options.stop_grace_s)
    return results[0]


def generate_on_world(model_dir: str | Path, prompt: str | None, prompt_ids: list[int] | None,
                      params: SamplingParams, *, dp: int, cp: int, dtype: str | None = None,
                      load_format: LoadFormat = "auto", enforce_eager: bool = False,
                      speculative: SpeculativeConfig | None = None) -> GenerationResult:
    """One prompt (text or ids) on a local dp x cp world; what ``helixserve generate --dp --cp`` prints.

    ``dtype`` None means float32, the single-process CLI's CPU default, on GPUs too: the output is
    meant to equal ``helixserve generate`` without ``--dp/--cp`` on the same checkpoint.
    """
    source = prompt_ids if prompt_ids is not None else prompt
    if source is None:
        raise ValueError("give a prompt or prompt ids")
    return generate_many_on_world(model_dir, [source], params, dp=dp, cp=cp, options=WorldOptions(
        dtype=dtype or "float32", load_format=load_format, use_cuda_graphs=not enforce_eager,
        speculative=speculative))[0]
