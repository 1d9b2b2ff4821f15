"""Plans for a role on a mapping, and the smallest mappings that fit (torch-free).

A **gen** mapping is a ``dp x cp`` helix_a2a world (:mod:`helixserve.models.sharding`); its
target is ``batch`` sequences of ``context_len`` tokens decoding at once over the world (each
CP group holds ``1 / dp`` of them). A **ctx** mapping is one worker (``dp = 1``): one GPU, or a
ctx world of ``tp`` ranks (``ctx[].tp``, ep = tp) laid out as the helix layout dp 1 x cp tp when
one GPU cannot hold the model (:func:`ctx_layouts` lists the ones the model can take); its target
is ``ctx_batch`` prefilled sequences held at once.

With speculative decoding a model drafter (:mod:`.drafter`: a draft model or a hidden-state
drafter) is counted on CP rank 0, the group's leader that holds it: its weights (a heads-TP share
on every rank when the draft's heads are split over the group) and its pools, which come out of
every rank's cache budget alike. ``ngram`` speculation costs nothing here.

Two ways to size the pools: from a config's ``cache.memory_budget_mib`` / ``max_num_seqs``
(:func:`plan_configured`, what the engine allocates), or filling what the GPU has left after
weights, activations and graph pools (:func:`plan_filled`, which also gives the cache settings
to write into the config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helixserve.config import CacheConfig
from helixserve.kvcache.helix import num_local_blocks
from helixserve.kvcache.sizing import pools_from_budget
from helixserve.models.config import KimiModelConfig
from helixserve.planning.drafter import Drafter, drafter_problems
from helixserve.planning.memory import (
    MIB,
    PoolBytes,
    RankMemory,
    budget_unit_bytes,
    checkpoint_slot_count,
    engine_pool_sizes,
    pool_unit_bytes,
    rank_memory,
)

ROLES = ("ctx", "gen")
MAX_WORLD_SIZE = 4096


@dataclass(frozen=True, slots=True)
class PlanTarget:
    """What a deployment must hold: sequences of ``context_len`` tokens, ``batch`` decoding on
    the gen world, ``ctx_batch`` held by a ctx worker; and how the engine runs."""

    context_len: int
    batch: int = 1
    ctx_batch: int = 1
    tokens_per_block: int = 16
    max_num_batched_tokens: int = 2048
    itemsize: int = 2  # bf16
    expert_format: str | None = None  # None: the checkpoint's
    cuda_graphs: bool = True

    def sequences_needed(self, role: str) -> int:
        return self.ctx_batch if role == "ctx" else self.batch


@dataclass(frozen=True, slots=True)
class RolePlan:
    """One role on one mapping: a GPU's memory, the sequences the mapping holds, the target;
    ``drafter``: the model drafter counted on its rank (:mod:`.drafter`); ``max_model_len``: a
    ``cache.max_model_len`` to configure too (a drafter with fewer positions than the pools hold)."""

    memory: RankMemory
    sequences_per_group: int
    sequences_needed: int
    memory_budget_mib: int  # cache.memory_budget_mib that gives these pools
    max_num_seqs: int
    problems: tuple[str, ...] = ()
    drafter: Drafter | None = None
    max_model_len: int | None = None

    @property
    def num_gpus(self) -> int:
        return self.memory.dp * self.memory.cp

    @property
    def sequences(self) -> int:
        return self.memory.dp * self.sequences_per_group

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory.fits and self.sequences >= self.sequences_needed


def _pools(cfg: KimiModelConfig, t: PlanTarget, cp: int, drafter: Drafter | None, num_blocks: int, num_slots: int,
           checkpoint_slots: int = 0) -> PoolBytes:
    """The pools of CP rank 0 (with a CUDA-graph scratch slot), a ``drafter``'s beside them."""
    block, slot = pool_unit_bytes(cfg, t.itemsize, t.tokens_per_block, cp)
    pools = PoolBytes(block, slot, num_blocks, num_slots, scratch_slots=1, checkpoint_slots=checkpoint_slots)
    return pools if drafter is None else drafter.pools(pools, t.itemsize, t.tokens_per_block, cp)


def _memory(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget, pools: PoolBytes,
            max_num_seqs: int, drafter: Drafter | None) -> RankMemory:
    batched = max(t.max_num_batched_tokens, max_num_seqs)  # the scheduler's token budget
    return rank_memory(cfg, role, dp, cp, t.itemsize, pools, batched, max_num_seqs, t.cuda_graphs, gpu_bytes,
                       t.expert_format, None if drafter is None else drafter.weight_bytes(t.itemsize))


def _check(cfg: KimiModelConfig, role: str, dp: int, cp: int, t: PlanTarget,
           drafter: Drafter | None) -> tuple[str, ...]:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    problems = cfg.helix_mapping_problems(dp, cp) if dp * cp > 1 else []
    if role == "ctx" and dp != 1:
        problems.append(f"a ctx worker is one world (dp 1), got dp {dp}")
    if t.context_len > cfg.max_position_embeddings:
        problems.append(f"context_len {t.context_len} exceeds the model's {cfg.max_position_embeddings} positions")
    if drafter is not None:
        problems += drafter_problems(drafter, role, cp, t.context_len)
    return tuple(problems)


def _draft_args(drafter: Drafter | None, t: PlanTarget) -> dict[str, Any]:
    return {} if drafter is None else drafter.budget_args(t.itemsize)


def _drafter_positions(cfg: KimiModelConfig, cp: int, t: PlanTarget, drafter: Drafter | None, num_blocks: int,
                       max_model_len: int | None) -> int | None:
    """The ``cache.max_model_len`` a ``drafter`` needs (``None``: none): its positions, when the
    engine would take longer sequences (:func:`~helixserve.engine.draft_runner.build_draft_runner`)."""
    engine_len = min(max_model_len or cfg.max_position_embeddings, num_blocks * t.tokens_per_block * cp)
    if drafter is None or drafter.cfg.max_position_embeddings >= engine_len:
        return None
    return drafter.cfg.max_position_embeddings


def plan_configured(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget,
                    cache: CacheConfig, drafter: Drafter | None = None) -> RolePlan:
    """``role`` on ``dp x cp`` with the pools a config's cache settings give (the engine's: its
    budget, sequences and KDA state checkpoints; a model ``drafter``'s pools out of the same
    budget, its weights on the rank that holds it)."""
    memory_budget_mib, max_num_seqs = cache.memory_budget_mib, cache.max_num_seqs
    problems = _check(cfg, role, dp, cp, t, drafter)
    slot = pool_unit_bytes(cfg, t.itemsize, t.tokens_per_block, cp)[1]
    num_checkpoint_slots = checkpoint_slot_count(cache, slot if cfg.kda_layer_ids else 0)
    try:
        num_blocks, num_slots = engine_pool_sizes(cfg, t.itemsize, t.tokens_per_block, memory_budget_mib,
                                                  max_num_seqs, cp, num_checkpoint_slots, **_draft_args(drafter, t))
    except ValueError as exc:
        problems, num_blocks, num_slots = (*problems, str(exc)), 0, 0
    positions = _drafter_positions(cfg, cp, t, drafter, num_blocks, cache.max_model_len)
    if positions is not None:
        assert drafter is not None
        problems = (*problems, f"the drafter {drafter.path} has max_position_embeddings {positions} < the engine's "
                               f"max_model_len: set cache.max_model_len <= {positions}")
    pools = _pools(cfg, t, cp, drafter, num_blocks, num_slots, num_checkpoint_slots)
    memory = _memory(cfg, role, dp, cp, gpu_bytes, t, pools, max_num_seqs, drafter)
    seqs = pools.sequences_at(t.context_len, t.tokens_per_block, cp)
    return RolePlan(memory, seqs, t.sequences_needed(role), int(memory_budget_mib), max_num_seqs, problems, drafter)


def plan_filled(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget,
                drafter: Drafter | None = None) -> RolePlan:
    """``role`` on ``dp x cp`` with pools filling what the GPU has left: the most sequences of
    ``context_len`` tokens that fit with their activations (logits rows; the scheduler's token
    budget is at least ``max_num_seqs``) and a model ``drafter``'s weights and pools, in whole MiB
    of cache budget."""
    problems = _check(cfg, role, dp, cp, t, drafter)
    block, slot = budget_unit_bytes(cfg, t.itemsize, t.tokens_per_block, cp, **_draft_args(drafter, t))
    per_seq = slot + num_local_blocks(t.context_len, t.tokens_per_block, 0, cp) * block

    def with_sequences(n: int) -> RolePlan | None:
        """The plan holding ``n`` sequences with the smallest whole-MiB budget, if it fits."""
        budget_mib = -(-(n * per_seq) // MIB)
        num_blocks, num_slots = pools_from_budget(block, slot, budget_mib * MIB, n)
        memory = _memory(cfg, role, dp, cp, gpu_bytes, t, _pools(cfg, t, cp, drafter, num_blocks, num_slots), n,
                         drafter)
        if not memory.fits:
            return None
        return RolePlan(memory, memory.pools.sequences_at(t.context_len, t.tokens_per_block, cp),
                        t.sequences_needed(role), budget_mib, n, problems, drafter,
                        _drafter_positions(cfg, cp, t, drafter, num_blocks, None))

    low, high = 0, gpu_bytes // max(1, per_seq)  # with_sequences(high + 1) cannot fit
    while low < high:  # the largest n that fits (fitting is monotone in n)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if with_sequences(mid) is not None else (low, mid - 1)
    if low == 0:
        empty = _pools(cfg, t, cp, drafter, 0, 0)
        return RolePlan(_memory(cfg, role, dp, cp, gpu_bytes, t, empty, 1, drafter), 0, t.sequences_needed(role), 0,
                        0, problems, drafter)
    best = with_sequences(low)
    assert best is not None
    return best


def mappings(cfg: KimiModelConfig, role: str, world_size: int) -> list[tuple[int, int]]:
    """The ``(dp, cp)`` of ``world_size`` ranks the model can be laid out on for ``role``."""
    cps = [world_size] if role == "ctx" else [c for c in range(1, world_size + 1) if world_size % c == 0]
    return [(world_size // c, c) for c in cps
            if world_size == 1 or not cfg.helix_mapping_problems(world_size // c, c)]


def smallest_mapping(cfg: KimiModelConfig, role: str, gpu_bytes: int, t: PlanTarget,
                     max_world_size: int = MAX_WORLD_SIZE, drafter: Drafter | None = None) -> RolePlan | None:
    """The plan with the fewest GPUs that fits (``None``: none up to ``max_world_size``); among
    mappings of that many GPUs, the one holding the most sequences, then the smaller ``cp``."""
    for n in range(1, max_world_size + 1):
        if n > 1 and cfg.moe_layer_ids and cfg.num_experts % n:
            continue  # experts are partitioned over the whole world
        plans = [plan_filled(cfg, role, dp, cp, gpu_bytes, t, drafter) for dp, cp in mappings(cfg, role, n)]
        fitting = [p for p in plans if p.fits]
        if fitting:
            return max(fitting, key=lambda p: (p.sequences, -p.memory.cp))
    return None


def ctx_layouts(cfg: KimiModelConfig, gpu_bytes: int, t: PlanTarget, max_tp: int = MAX_WORLD_SIZE,
                drafter: Drafter | None = None) -> list[RolePlan]:
    """Every ctx world the model can be laid out on (``tp`` ranks, ep = tp: heads and experts
    divide), ascending, each with pools filling what its GPUs have left (``fits`` says whether
    its shard fits); a smaller ``tp`` than the first that fits is listed to show the shortfall."""
    return [plan_filled(cfg, "ctx", 1, tp, gpu_bytes, t, drafter) for tp in range(1, max_tp + 1)
            if tp == 1 or not cfg.helix_mapping_problems(1, tp)]
