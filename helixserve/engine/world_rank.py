"""What a rank of a helix_a2a gen world runs: its bootstrap, its part, its serve loop. Starting
the processes is not the engine's: a gen worker's local world is
:mod:`helixserve.serving.local_world`, the CLI's offline ``generate --dp --cp`` is
:mod:`helixserve.launch.offline`, and srun/torchrun start the tasks of a multi-node world.

- :func:`build_rank`: one rank's part from a checkpoint (sharded load): a CP group's leader gets
  the group's :class:`~helixserve.engine.core.EngineCore`, another rank a
  :class:`~helixserve.engine.spmd.follower.Follower` (its cache shard, sized alike, and runner).
- :func:`start_rank0`: rank 0 joins and gets the world's
  :class:`~helixserve.engine.spmd.driver.WorldDriver` (which goes to ``AsyncEngine``);
  :func:`run_rank` is what every other rank runs until shutdown: a leader its own
  :class:`~helixserve.engine.spmd.driver.WorldDriver`'s steps, a follower its leader's messages.
- :func:`check_fits_world`: a world's start-up errors, before any process is started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from helixserve.cache_layout import ModelCaches
from helixserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig, WorldRunConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.model_drafters import build_model_drafter, drafter_capture_layers
from helixserve.engine.kv_holds import HoldRelay, RankHolds, ShardSenderFactory
from helixserve.engine.kv_intake import RankTransfers, ShardReceiver
from helixserve.engine.llm import resolve_dtype
from helixserve.engine.rank_setup import (allocate_checkpoints, allocate_rank_caches, decode_graph_shape,
                                          decode_graphs_off_reason, size_cache, step_token_budget)
from helixserve.engine.runner import ModelRunner
from helixserve.engine.spmd.channel import GroupChannel
from helixserve.engine.spmd.driver import WorldDriver, serve_leader
from helixserve.engine.spmd.follower import Follower, serve_follower
from helixserve.kernels.triton_common import set_batch_invariant
from helixserve.models.checkpoint import ExpertFormat
from helixserve.models.config import KimiModelConfig
from helixserve.models.dummy import LoadFormat, load_dummy_model, model_config_of, tokenizer_of
from helixserve.models.helix_load import load_helix_model
from helixserve.models.sharding import check_helix_config
from helixserve.parallel import Mapping, ParallelGroups, init_parallel
from helixserve.planning.drafter import resolve_drafter
from helixserve.transceiver.consensus import TransferConsensus

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
    # drafted and verified on each CP group's leader (a heads-TP draft model drafts on every rank)
    speculative: SpeculativeConfig | None = None
    kv_sender: ShardSenderFactory | None = None  # a ctx world's: each rank's KV sender (engine.kv_holds)


def uses_static_moe(options: WorldOptions, mapping: Mapping, device: torch.device) -> bool:
    """Whether this world's ranks run the static helix step (the same answer on every rank: it
    depends on the world's options and device kind only)."""
    del device  # the same answer on every device kind (see WorldOptions.static_moe)
    return mapping.world_size > 1 and options.static_moe  # a world of one calls no hook


# ``factory(mapping) -> ShardReceiver`` for a rank (module-level / picklable for spawned ranks)
ShardReceiverFactory = Callable[[Mapping, torch.device], ShardReceiver]  # (this rank, its device)


RankPart = EngineCore | Follower


def build_rank(model_dir: str | Path, groups: ParallelGroups, options: WorldOptions = WorldOptions(),
               kv_receiver: ShardReceiver | None = None) -> RankPart:
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
        core = EngineCore(model, model.cfg, tokenizer_of(model_dir, options.load_format), options.cache, options.scheduler, groups.device,
                          options.seed, options.use_cuda_graphs, groups=groups, kv_receiver=kv_receiver,
                          speculative=options.speculative)
        if options.kv_sender is not None:
            holds, endpoints = _rank_holds(options.kv_sender, groups, core.caches)
            assert core.group is not None
            core.kv_holds = HoldRelay(core.cache_manager, holds, core.group, endpoints)
        return core
    # sized as the leader is, its drafter's pools counted: every rank has the group's block count
    drafter = resolve_drafter(options.speculative, model.cfg, options.cache)
    spec, layout = size_cache(model.cfg, dtype, options.cache, mapping.cp, drafter)
    caches = allocate_rank_caches(spec, layout, groups.device)
    runner = ModelRunner(model, caches, groups.device, seed=options.seed)
    # a heads-TP drafter runs here too, on the leader's work (engine.draft_runner, engine.hidden_work)
    draft_runner = (build_model_drafter(options.speculative, drafter, dtype, layout, groups.device, None,
                                        mapping.cp, groups) if drafter is not None and drafter.tp > 1 else None)
    runner.checkpoints = allocate_checkpoints(spec, layout, groups.device)  # the group's checkpoint slots
    # the layers a hidden drafter reads, kept as the leader keeps them (their gather joins the group's)
    runner.capture_layers = drafter_capture_layers(options.speculative)
    # the leaders capture in EngineCore, with the same shapes and at the same time: every rank's
    # graphs hold the same collectives in the same order
    if decode_graphs_off_reason(model, groups.device, options.use_cuda_graphs, mapping.world_size,
                                runner.capture_layers) is None:
        runner.capture_decode_graphs(*decode_graph_shape(options.cache, layout))
    holds = _rank_holds(options.kv_sender, groups, caches)[0] if options.kv_sender is not None else None
    return Follower(runner, GroupChannel(groups), RankTransfers(kv_receiver, caches, TransferConsensus(groups.cp_cpu)),
                    holds=holds, draft=draft_runner)


def _rank_holds(factory: ShardSenderFactory, groups: ParallelGroups, caches: ModelCaches) -> tuple[RankHolds, list]:
    """This rank's KV sender (started) and every rank's endpoint, in rank order (one all-gather
    over the CP group: every rank of a ctx world builds its sender here, in the same order)."""
    sender = factory(groups.mapping, caches)
    try:
        endpoints: list = [None] * groups.mapping.cp
        dist.all_gather_object(endpoints, sender.endpoint, group=groups.cp_cpu)
    except BaseException:
        sender.close()
        raise
    return RankHolds(sender, groups.cp_cpu, groups.mapping.cp), endpoints


def serve_rank(part: RankPart) -> int:
    """A rank != 0: a leader serves rank 0's plans, a follower its leader's messages; until
    shutdown. Returns the steps run."""
    if isinstance(part, Follower):
        return serve_follower(part)
    return serve_leader(WorldDriver(part))


def groups_of(part: RankPart) -> ParallelGroups:
    return part.channel.groups if isinstance(part, Follower) else part.group.channel.groups  # type: ignore[union-attr]


def pick_backend(world_size: int, backend: str | None = None) -> str:
    if backend is not None:
        return backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def check_fits_world(cfg: KimiModelConfig, dp: int, cp: int) -> None:
    """Start-up errors (indivisible heads / experts, layer order) before spawning anything."""
    check_helix_config(cfg, Mapping(dp * cp, 0, dp=dp, cp=cp))


def _join(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions,
          kv_receiver_factory: ShardReceiverFactory | None, local_rank: int) -> RankPart:
    groups = init_parallel(mapping, init_method, backend=pick_backend(mapping.world_size, options.backend),
                           local_rank=local_rank, timeout_s=options.timeout_s)
    try:
        receiver = kv_receiver_factory(mapping, groups.device) if kv_receiver_factory is not None else None
        return build_rank(model_dir, groups, options, receiver)
    except BaseException:
        groups.destroy()
        raise


def run_rank(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
             kv_receiver_factory: ShardReceiverFactory | None = None, local_rank: int | None = None) -> int:
    """A rank != 0 of a gen world: join, load its shard, serve until shutdown; step count.

    Raises when the world fails (the process should then exit so the other ranks fail fast).
    """
    if mapping.rank == 0:
        raise ValueError("rank 0 drives the world: use start_rank0 / start_local_world")
    part = _join(model_dir, mapping, init_method, options, kv_receiver_factory,
                 mapping.rank if local_rank is None else local_rank)
    try:
        return serve_rank(part)
    finally:
        if isinstance(part, Follower) and part.holds is not None:
            part.holds.close()
        groups_of(part).destroy()


def start_rank0(model_dir: str | Path, mapping: Mapping, init_method: str, options: WorldOptions = WorldOptions(),
                kv_receiver_factory: ShardReceiverFactory | None = None, heartbeat_s: float | None = None,
                local_rank: int = 0, driver_cls: type[WorldDriver] = WorldDriver) -> WorldDriver:
    """Rank 0 joins the world (blocks until every rank did) and returns its driver."""
    if mapping.rank != 0:
        raise ValueError(f"start_rank0 on rank {mapping.rank}")
    core = _join(model_dir, mapping, init_method, options, kv_receiver_factory, local_rank)
    assert isinstance(core, EngineCore)
    return driver_cls(core, heartbeat_s)
