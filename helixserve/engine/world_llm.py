"""Starting helix_a2a gen worlds: rank bootstrap, a server's world, the CLI's ``generate --dp --cp``.

- :func:`build_rank_engine`: one rank's :class:`~helixserve.engine.spmd.RankEngine` from a
  checkpoint (sharded load, cache shard sized like ``EngineCore``'s, scheduler replica).
- :func:`start_local_world`: a server process becomes rank 0 (its
  :class:`~helixserve.engine.spmd.WorldDriver` goes to ``AsyncEngine``) and spawns ranks
  1..world-1 as local processes; :func:`run_rank` is what those ranks (or srun/torchrun tasks of a
  multi-node world) run.
- :func:`generate_on_world` / :func:`generate_many_on_world`: spawn dp x cp local processes (gloo
  on CPU; NCCL, one GPU per rank, when enough GPUs are present), run the prompts through rank 0's
  :class:`~helixserve.engine.spmd.WorldDriver`, return results like ``LLM.generate``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import logging
import multiprocessing as mp
import signal
from collections.abc import Callable

import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import GenerationResult, resolve_dtype
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.runner import cache_spec_for
from helixserve.engine.scheduler import Scheduler
from helixserve.engine.spmd import KVReceiver, RankEngine, WorldDriver, serve_rank
from helixserve.engine.stop import truncate_at_stop
from helixserve.kvcache.manager import CacheManager
from helixserve.kvcache.pools import allocate_model_caches, size_from_budget
from helixserve.models.helix_load import load_helix_model
from helixserve.models.tokenizer import HelixTokenizer, load_tokenizer
from helixserve.parallel import Mapping, ParallelGroups, init_parallel, run_local_world
from helixserve.parallel.launch import free_port

logger = logging.getLogger(__name__)

_MIB = 1 << 20


@dataclass(slots=True, frozen=True)
class WorldOptions:
    """How to build each rank (defaults match the single-process ``LLM``)."""

    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    dtype: str | None = None
    seed: int = 0
    timeout_s: float = 120.0
    backend: str | None = None  # None: nccl when every rank gets a GPU, else gloo


# ``factory(mapping) -> KVReceiver`` for a rank (module-level / picklable for spawned ranks)
KVReceiverFactory = Callable[[Mapping], KVReceiver]


def _tokenizer(model_dir: Path) -> HelixTokenizer | None:
    return load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None


def build_rank_engine(model_dir: str | Path, groups: ParallelGroups, options: WorldOptions = WorldOptions()) -> RankEngine:
    """Load this rank's model shard and build its cache shard and scheduler replica."""
    model_dir = Path(model_dir)
    mapping = groups.mapping
    dtype = resolve_dtype(options.dtype, groups.device)
    model = load_helix_model(model_dir, mapping, dtype=dtype, device=groups.device).bind(groups)
    cfg, cache = model.cfg, options.cache
    spec = cache_spec_for(cfg, dtype, cache.tokens_per_block, kda_num_heads=model.kda_num_local_heads)
    num_blocks, num_slots = size_from_budget(spec, int(cache.memory_budget_mib * _MIB), cache.max_num_seqs)
    # CP-group-uniform accounting: a group holds about cp times one rank's blocks
    max_model_len = min(cache.max_model_len or cfg.max_position_embeddings, num_blocks * cache.tokens_per_block * mapping.cp)
    caches = allocate_model_caches(spec, num_blocks, num_slots, groups.device)
    manager = CacheManager(num_blocks, num_slots, cache.tokens_per_block, cp_rank=mapping.cp_rank, cp_size=mapping.cp,
                           has_mla=bool(spec.mla_layer_ids), has_kda=bool(spec.kda_layer_ids))
    tokenizer = _tokenizer(model_dir)
    eos = set(tokenizer.eos_token_ids) if tokenizer else set()
    if cfg.eos_token_id is not None:
        eos.add(cfg.eos_token_id)
    scheduler = Scheduler(
        manager, max_num_seqs=cache.max_num_seqs,
        max_num_batched_tokens=max(options.scheduler.max_num_batched_tokens, cache.max_num_seqs),
        max_model_len=max_model_len, eos_token_ids=eos, detokenize=tokenizer.decode if tokenizer else None,
    )
    return RankEngine(model, groups, caches, manager, scheduler, seed=options.seed)


def pick_backend(world_size: int, backend: str | None = None) -> str:
    if backend is not None:
        return backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _world_main(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                prompts: list[list[int]], params: list[SamplingParams], options: WorldOptions) -> list[GenerationResult] | int:
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend=pick_backend(world_size, options.backend),
                           local_rank=rank, timeout_s=options.timeout_s)
    try:
        engine = build_rank_engine(model_dir, groups, options)
        if rank != 0:
            return serve_rank(engine)
        driver = WorldDriver(engine)
        try:
            return drive_to_completion(driver, prompts, params, _tokenizer(Path(model_dir)))
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def drive_to_completion(driver: WorldDriver, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                        tokenizer: HelixTokenizer | None = None) -> list[GenerationResult]:
    """Add every prompt, step the world until all finish; results in prompt order."""
    ids = [f"world-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    errors: dict[str, str | None] = {}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        driver.add_request(rid, list(prompt), p)
    while driver.has_unfinished_requests():
        for update in driver.step():
            if update.status not in (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED):
                tokens[update.request_id].append(update.token_id)
            if update.is_finished:
                reasons[update.request_id] = update.status.finish_reason
                errors[update.request_id] = update.error
    results = []
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        text = truncate_at_stop(tokenizer.decode(tokens[rid]), p.stop) if tokenizer else ""
        results.append(GenerationResult(rid, list(prompt), tokens[rid], text, reasons.get(rid), errors.get(rid)))
    return results


def generate_many_on_world(model_dir: str | Path, prompts: Sequence[str | list[int]],
                           params: SamplingParams | Sequence[SamplingParams], *, dp: int, cp: int,
                           options: WorldOptions = WorldOptions(), timeout_s: float = 600.0) -> list[GenerationResult]:
    """Run every prompt on a fresh local dp x cp world; results in prompt order."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    if dp < 1 or cp < 1:
        raise ValueError(f"dp={dp} and cp={cp} must be >= 1")
    tokenizer = _tokenizer(model_dir)
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{model_dir} has no tokenizer.json: pass token ids")
            prompt = tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        encoded.append(list(prompt))
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
    _check_fits_world(model_dir, dp, cp)
    results = run_local_world(_world_main, dp * cp, str(model_dir), dp, cp, encoded, params_list, options,
                              timeout_s=timeout_s)
    return results[0]


def _check_fits_world(model_dir: Path, dp: int, cp: int) -> None:
    """Start-up errors (indivisible heads / experts, layer order) before spawning anything."""
    from helixserve.models.config import KimiModelConfig
    from helixserve.models.sharding import check_helix_config

    check_helix_config(KimiModelConfig.from_pretrained(model_dir), Mapping(dp * cp, 0, dp=dp, cp=cp))


def generate_on_world(model_dir: str | Path, prompt: str | None, prompt_ids: list[int] | None,
                      params: SamplingParams, *, dp: int, cp: int, dtype: str | None = None) -> GenerationResult:
    """One prompt (text or ids) on a local dp x cp world; what ``helixserve generate --dp --cp`` prints.

    ``dtype`` None means float32, the single-process CLI's CPU default, on GPUs too: the output is
    meant to equal ``helixserve generate`` without ``--dp/--cp`` on the same checkpoint.
    """
    source = prompt_ids if prompt_ids is not None else prompt
    if source is None:
        raise ValueError("give a prompt or prompt ids")
    return generate_many_on_world(model_dir, [source], params, dp=dp, cp=cp, options=WorldOptions(dtype=dtype or "float32"))[0]


# ---------------------------------------------------------------- a server's world


def _join(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions,
          kv_receiver_factory: KVReceiverFactory | None, local_rank: int) -> RankEngine:
    groups = init_parallel(mapping, init_method, backend=pick_backend(mapping.world_size, options.backend),
                           local_rank=local_rank, timeout_s=options.timeout_s)
    try:
        engine = build_rank_engine(model_dir, groups, options)
        if kv_receiver_factory is not None:
            engine.kv_receiver = kv_receiver_factory(mapping)
    except BaseException:
        groups.destroy()
        raise
    return engine


def run_rank(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
             kv_receiver_factory: KVReceiverFactory | None = None, local_rank: int | None = None) -> int:
    """A rank != 0 of a gen world: join, load its shard, serve plans until shutdown; step count.

    Raises when the world fails (the process should then exit so the other ranks fail fast).
    """
    if mapping.rank == 0:
        raise ValueError("rank 0 drives the world: use start_rank0 / start_local_world")
    engine = _join(model_dir, mapping, init_method, options, kv_receiver_factory,
                   mapping.rank if local_rank is None else local_rank)
    try:
        return serve_rank(engine)
    finally:
        engine.groups.destroy()


def start_rank0(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
                kv_receiver_factory: KVReceiverFactory | None = None, heartbeat_s: float | None = None,
                local_rank: int = 0, driver_cls: type[WorldDriver] = WorldDriver) -> WorldDriver:
    """Rank 0 joins the world (blocks until every rank did) and returns its driver."""
    if mapping.rank != 0:
        raise ValueError(f"start_rank0 on rank {mapping.rank}")
    return driver_cls(_join(model_dir, mapping, init_method, options, kv_receiver_factory, local_rank), heartbeat_s)


def _local_rank_main(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                     options: WorldOptions, kv_receiver_factory: KVReceiverFactory | None) -> None:
    torch.set_num_threads(1)
    # a SIGTERM to the server's process group is rank 0's to handle: it sends the shutdown plan
    # (and if rank 0 dies instead, this rank's next collective fails and the process ends)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_rank(model_dir, Mapping(world_size, rank, dp=dp, cp=cp), init_method, options, kv_receiver_factory)


@dataclass(slots=True)
class LocalWorld:
    """Rank 0 (this process) and the spawned ranks of a one-machine gen world."""

    driver: WorldDriver
    processes: list[mp.process.BaseProcess]

    def is_alive(self) -> bool:
        return self.driver.failure is None and all(p.is_alive() for p in self.processes)

    def close(self, grace_s: float = 10.0) -> None:
        """Shut the ranks down (or kill them after ``grace_s``) and leave the process groups."""
        try:
            self.driver.shutdown()
        except Exception as exc:  # noqa: BLE001 - the world is going away anyway
            logger.warning("gen world shutdown plan failed: %s", exc)
        for proc in self.processes:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                logger.warning("killing gen world rank process %d", proc.pid)
                proc.kill()
                proc.join()
        self.driver.rank.groups.destroy()


def start_local_world(model_dir: str | Path, *, dp: int, cp: int, options: WorldOptions = WorldOptions(),
                      kv_receiver_factory: KVReceiverFactory | None = None,
                      heartbeat_s: float | None = None, local_rank: int = 0,
                      driver_cls: type[WorldDriver] = WorldDriver) -> LocalWorld:
    """Make this process rank 0 of a dp x cp world whose other ranks are spawned here.

    ``local_rank``: rank 0's CUDA device index under NCCL (spawned rank r uses r).
    """
    model_dir = Path(model_dir)
    _check_fits_world(model_dir, dp, cp)
    world_size = dp * cp
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("forkserver")
    processes = [
        ctx.Process(target=_local_rank_main, name=f"gen-world-rank-{rank}", daemon=True,
                    args=(rank, world_size, init_method, str(model_dir), dp, cp, options, kv_receiver_factory))
        for rank in range(1, world_size)
    ]
    for proc in processes:
        proc.start()
    try:
        driver = start_rank0(model_dir, Mapping(world_size, 0, dp=dp, cp=cp), init_method, options,
                             kv_receiver_factory, heartbeat_s, local_rank, driver_cls)
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    return LocalWorld(driver, processes)
