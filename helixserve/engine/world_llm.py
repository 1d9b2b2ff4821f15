"""Starting helix_a2a gen worlds: rank bootstrap, a server's world, the CLI's ``generate --dp --cp``.

- :func:`build_rank`: one rank's part from a checkpoint (sharded load): a CP group's leader gets
  the group's :class:`~helixserve.engine.core.EngineCore`, another rank a
  :class:`~helixserve.engine.spmd.follower.Follower` (its cache shard, sized alike, and runner).
- :func:`start_local_world`: a server process becomes rank 0 (its
  :class:`~helixserve.engine.spmd.driver.WorldDriver` goes to ``AsyncEngine``) and spawns ranks
  1..world-1 as local processes; :func:`run_rank` is what those ranks (or srun/torchrun tasks of a
  multi-node world) run.
- :func:`generate_on_world` / :func:`generate_many_on_world`: spawn dp x cp local processes (gloo
  on CPU; NCCL, one GPU per rank, when enough GPUs are present), run the prompts through rank 0's
  :class:`~helixserve.engine.spmd.driver.WorldDriver`, return results like ``LLM.generate``'s.
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

from helixserve.cache_layout import cache_spec_for
from helixserve.config import CacheConfig, SchedulerConfig, WorldRunConfig, reserved_ports
from helixserve.engine.llm import GenerationResult, resolve_dtype
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.core import EngineCore
from helixserve.engine.rank_setup import (allocate_rank_caches, decode_graph_shape, decode_graphs_off_reason,
                                          size_cache, step_token_budget)
from helixserve.engine.kv_intake import KVReceiver, RankTransfers
from helixserve.engine.runner import ModelRunner
from helixserve.engine.spmd.channel import GroupChannel
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.spmd.follower import Follower, serve_follower
from helixserve.engine.spmd.leader import serve_leader
from helixserve.engine.stop import truncate_at_stop
from helixserve.kernels.triton_common import set_batch_invariant
from helixserve.launch.processes import run_local_world
from helixserve.models.checkpoint import ExpertFormat
from helixserve.models.config import KimiModelConfig
from helixserve.models.dummy import LoadFormat, load_dummy_model, model_config_of, tokenizer_of
from helixserve.models.helix_load import load_helix_model
from helixserve.models.tokenizer import HelixTokenizer, no_tokenizer_message
from helixserve.parallel import Mapping, ParallelGroups, init_parallel
from helixserve.parallel.ports import free_port
from helixserve.transceiver.consensus import TransferConsensus

logger = logging.getLogger(__name__)

_MIB = 1 << 20
_OFFLINE = WorldRunConfig()  # the waits' defaults (config.py); a gen worker passes its own


@dataclass(slots=True, frozen=True)
class WorldOptions:
    """How to build each rank (defaults match the single-process ``LLM``; the waits default to
    :class:`~helixserve.config.WorldRunConfig`'s: ``timeout_s`` per collective, ``run_timeout_s``
    for a whole offline run, ``stop_grace_s`` for the spawned ranks to exit)."""

    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    dtype: str | None = None
    experts: ExpertFormat = "auto"  # MXFP4 routed experts packed or dense (models.checkpoint)
    seed: int = 0
    timeout_s: float = _OFFLINE.collective_timeout_s
    run_timeout_s: float = _OFFLINE.run_timeout_s
    stop_grace_s: float = _OFFLINE.stop_grace_s
    backend: str | None = None  # None: nccl when every rank gets a GPU, else gloo
    deterministic: bool = False  # batch-invariant kernels (kernels.set_batch_invariant) on every rank
    load_format: LoadFormat = "auto"  # "dummy": seeded random weights (models.dummy), no weight read
    use_cuda_graphs: bool = True  # decode steps on a GPU are CUDA graphs (a world > 1: with static_moe)
    # the static helix step (HelixHooks.set_static): padded MoE all-to-all (capacity: each step's
    # at dp 1, the step budget's at dp > 1), no host read; with it, a world of more than one rank
    # on CUDA captures its decode steps as CUDA graphs. Opt-in: that capture has not run on GPUs
    # yet (the two-GPU issue checks it), and eagerly the padded path is slower on the CPU
    static_moe: bool = False


def uses_static_moe(options: WorldOptions, mapping: Mapping, device: torch.device) -> bool:
    """Whether this world's ranks run the static helix step (the same answer on every rank: it
    depends on the world's options and device kind only)."""
    del device  # the same answer on every device kind (see WorldOptions.static_moe)
    return mapping.world_size > 1 and options.static_moe  # a world of one calls no hook


# ``factory(mapping) -> KVReceiver`` for a rank (module-level / picklable for spawned ranks)
KVReceiverFactory = Callable[[Mapping, torch.device], KVReceiver]  # (this rank, its device)


RankPart = EngineCore | Follower


def build_rank(model_dir: str | Path, groups: ParallelGroups, options: WorldOptions = WorldOptions(),
               kv_receiver: KVReceiver | None = None) -> RankPart:
    """Load this rank's model shard; a CP leader's EngineCore or a follower's parts (same cache sizes)."""
    model_dir = Path(model_dir)
    mapping = groups.mapping
    dtype = resolve_dtype(options.dtype, groups.device)
    if options.deterministic:
        set_batch_invariant(True)
    if options.load_format == "dummy":
        model = load_dummy_model(model_config_of(model_dir, "dummy"), dtype, groups.device, mapping,
                                 experts=options.experts, seed=options.seed).bind(groups)
    else:
        model = load_helix_model(model_dir, mapping, dtype=dtype, device=groups.device,
                                 experts=options.experts).bind(groups)
    if uses_static_moe(options, mapping, groups.device):  # every rank alike: the same capacities
        model.helix.set_static(step_token_budget(options.cache, options.scheduler), lse_rows=options.cache.max_num_seqs)
    if mapping.cp_rank == 0:
        return EngineCore(model, model.cfg, tokenizer_of(model_dir, options.load_format), options.cache, options.scheduler, groups.device,
                          options.seed, options.use_cuda_graphs, groups=groups, kv_receiver=kv_receiver)
    spec, layout = size_cache(model.cfg, dtype, options.cache, mapping.cp)
    caches = allocate_rank_caches(spec, layout, groups.device)
    runner = ModelRunner(model, caches, groups.device, seed=options.seed)
    # the leaders capture in EngineCore, with the same shapes and at the same time: every rank's
    # graphs hold the same collectives in the same order
    if decode_graphs_off_reason(model, groups.device, options.use_cuda_graphs, mapping.world_size) is None:
        runner.capture_decode_graphs(*decode_graph_shape(options.cache, layout))
    return Follower(runner, GroupChannel(groups), RankTransfers(kv_receiver, caches, TransferConsensus(groups.cp_cpu)))


def serve_rank(part: RankPart, dp: int) -> int:
    """A rank != 0: a leader serves rank 0's plans, a follower its leader's messages; until
    shutdown. Returns the steps run."""
    if isinstance(part, Follower):
        return serve_follower(part)
    return serve_leader(part, dp)


def groups_of(part: RankPart) -> ParallelGroups:
    return part.channel.groups if isinstance(part, Follower) else part.executor.channel.groups  # type: ignore[union-attr]


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
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            return serve_rank(part, dp)
        assert isinstance(part, EngineCore)
        driver = WorldDriver(part)
        try:
            return drive_to_completion(driver, prompts, params, tokenizer_of(model_dir, options.load_format))
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
    _check_fits_world(cfg, dp, cp)
    results = run_local_world(_world_main, dp * cp, str(model_dir), dp, cp, encoded, params_list, options,
                              timeout_s=options.run_timeout_s, grace_s=options.stop_grace_s)
    return results[0]


def _check_fits_world(cfg: KimiModelConfig, dp: int, cp: int) -> None:
    """Start-up errors (indivisible heads / experts, layer order) before spawning anything."""
    from helixserve.models.sharding import check_helix_config

    check_helix_config(cfg, Mapping(dp * cp, 0, dp=dp, cp=cp))


def generate_on_world(model_dir: str | Path, prompt: str | None, prompt_ids: list[int] | None,
                      params: SamplingParams, *, dp: int, cp: int, dtype: str | None = None,
                      load_format: LoadFormat = "auto", enforce_eager: bool = False) -> GenerationResult:
    """One prompt (text or ids) on a local dp x cp world; what ``helixserve generate --dp --cp`` prints.

    ``dtype`` None means float32, the single-process CLI's CPU default, on GPUs too: the output is
    meant to equal ``helixserve generate`` without ``--dp/--cp`` on the same checkpoint.
    """
    source = prompt_ids if prompt_ids is not None else prompt
    if source is None:
        raise ValueError("give a prompt or prompt ids")
    return generate_many_on_world(model_dir, [source], params, dp=dp, cp=cp, options=WorldOptions(
        dtype=dtype or "float32", load_format=load_format, use_cuda_graphs=not enforce_eager))[0]


# ---------------------------------------------------------------- a server's world


def _join(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions,
          kv_receiver_factory: KVReceiverFactory | None, local_rank: int) -> RankPart:
    groups = init_parallel(mapping, init_method, backend=pick_backend(mapping.world_size, options.backend),
                           local_rank=local_rank, timeout_s=options.timeout_s)
    try:
        receiver = kv_receiver_factory(mapping, groups.device) if kv_receiver_factory is not None else None
        return build_rank(model_dir, groups, options, receiver)
    except BaseException:
        groups.destroy()
        raise


def run_rank(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
             kv_receiver_factory: KVReceiverFactory | None = None, local_rank: int | None = None) -> int:
    """A rank != 0 of a gen world: join, load its shard, serve until shutdown; step count.

    Raises when the world fails (the process should then exit so the other ranks fail fast).
    """
    if mapping.rank == 0:
        raise ValueError("rank 0 drives the world: use start_rank0 / start_local_world")
    part = _join(model_dir, mapping, init_method, options, kv_receiver_factory,
                 mapping.rank if local_rank is None else local_rank)
    try:
        return serve_rank(part, mapping.dp)
    finally:
        groups_of(part).destroy()


def start_rank0(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
                kv_receiver_factory: KVReceiverFactory | None = None, heartbeat_s: float | None = None,
                local_rank: int = 0, driver_cls: type[WorldDriver] = WorldDriver) -> WorldDriver:
    """Rank 0 joins the world (blocks until every rank did) and returns its driver."""
    if mapping.rank != 0:
        raise ValueError(f"start_rank0 on rank {mapping.rank}")
    core = _join(model_dir, mapping, init_method, options, kv_receiver_factory, local_rank)
    assert isinstance(core, EngineCore)
    return driver_cls(core, heartbeat_s)


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
    stop_grace_s: float  # WorldOptions.stop_grace_s: close()'s default

    def is_alive(self) -> bool:
        return self.driver.failure is None and all(p.is_alive() for p in self.processes)

    def close(self, grace_s: float | None = None) -> None:
        """Shut the ranks down (or kill them after ``grace_s``, default ``stop_grace_s``) and
        leave the process groups."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
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
        self.driver.groups.destroy()


def start_local_world(model_dir: str | Path, *, dp: int, cp: int, options: WorldOptions = WorldOptions(),
                      kv_receiver_factory: KVReceiverFactory | None = None,
                      heartbeat_s: float | None = None, local_rank: int = 0,
                      driver_cls: type[WorldDriver] = WorldDriver) -> LocalWorld:
    """Make this process rank 0 of a dp x cp world whose other ranks are spawned here.

    ``local_rank``: rank 0's CUDA device index under NCCL (spawned rank r uses r).
    """
    model_dir = Path(model_dir)
    _check_fits_world(model_config_of(model_dir, options.load_format), dp, cp)
    world_size = dp * cp
    init_method = f"tcp://127.0.0.1:{free_port(reserved=reserved_ports())}"
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
    return LocalWorld(driver, processes, options.stop_grace_s)
