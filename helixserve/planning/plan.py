"""Plans for a role on a mapping, and the smallest mappings that fit (torch-free).

A **gen** mapping is a ``dp x cp`` helix_a2a world (:mod:`helixserve.models.sharding`); its
target is ``batch`` sequences of ``context_len`` tokens decoding at once over the world (each
CP group holds ``1 / dp`` of them). A **ctx** mapping is one worker (``dp = 1``): one GPU, or a
ctx world of ``tp`` ranks (``ctx[].tp``, ep = tp) laid out as the helix layout dp 1 x cp tp when
one GPU cannot hold the model (:func:`ctx_layouts` lists the ones the model can take); its target
is ``ctx_batch`` prefilled sequences held at once.

Two ways to size the pools: from a config's ``cache.memory_budget_mib`` / ``max_num_seqs``
(:func:`plan_configured`, what the engine allocates), or filling what the GPU has left after
weights, activations and graph pools (:func:`plan_filled`, which also gives the cache settings
to write into the config).
"""

from __future__ import annotations

from dataclasses import dataclass

from helixserve.config import CacheConfig
from helixserve.kvcache.helix import num_local_blocks
from helixserve.kvcache.sizing import pools_from_budget
from helixserve.models.config import KimiModelConfig
from helixserve.planning.memory import (
    MIB,
    PoolBytes,
    RankMemory,
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
    """One role on one mapping: a GPU's memory, the sequences the mapping holds, the target."""

    memory: RankMemory
    sequences_per_group: int
    sequences_needed: int
    memory_budget_mib: int  # cache.memory_budget_mib that gives these pools
    max_num_seqs: int
    problems: tuple[str, ...] = ()

    @property
    def num_gpus(self) -> int:
        return self.memory.dp * self.memory.cp

    @property
    def sequences(self) -> int:
        return self.memory.dp * self.sequences_per_group

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory.fits and self.sequences >= self.sequences_needed


def _memory(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget, pools: PoolBytes,
            max_num_seqs: int) -> RankMemory:
    batched = max(t.max_num_batched_tokens, max_num_seqs)  # the scheduler's token budget
    return rank_memory(cfg, role, dp, cp, t.itemsize, pools, batched, max_num_seqs, t.cuda_graphs, gpu_bytes,
                       t.expert_format)


def _check(cfg: KimiModelConfig, role: str, dp: int, cp: int, t: PlanTarget) -> tuple[str, ...]:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    problems = cfg.helix_mapping_problems(dp, cp) if dp * cp > 1 else []
    if role == "ctx" and dp != 1:
        problems.append(f"a ctx worker is one world (dp 1), got dp {dp}")
    if t.context_len > cfg.max_position_embeddings:
        problems.append(f"context_len {t.context_len} exceeds the model's {cfg.max_position_embeddings} positions")
    return tuple(problems)


def plan_configured(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget,
                    cache: CacheConfig) -> RolePlan:
    """``role`` on ``dp x cp`` with the pools a config's cache settings give (the engine's: its
    budget, sequences and KDA state checkpoints)."""
    memory_budget_mib, max_num_seqs = cache.memory_budget_mib, cache.max_num_seqs
    problems = _check(cfg, role, dp, cp, t)
    block, slot = pool_unit_bytes(cfg, t.itemsize, t.tokens_per_block, cp)
    num_checkpoint_slots = checkpoint_slot_count(cache, slot if cfg.kda_layer_ids else 0)
    try:
        num_blocks, num_slots = engine_pool_sizes(cfg, t.itemsize, t.tokens_per_block, memory_budget_mib,
                                                  max_num_seqs, cp, num_checkpoint_slots)
    except ValueError as exc:
        problems, num_blocks, num_slots = (*problems, str(exc)), 0, 0
    pools = PoolBytes(block, slot, num_blocks, num_slots, scratch_slots=1, checkpoint_slots=num_checkpoint_slots)
    memory = _memory(cfg, role, dp, cp, gpu_bytes, t, pools, max_num_seqs)
    seqs = pools.sequences_at(t.context_len, t.tokens_per_block, cp)
    return RolePlan(memory, seqs, t.sequences_needed(role), int(memory_budget_mib), max_num_seqs, problems)


def plan_filled(cfg: KimiModelConfig, role: str, dp: int, cp: int, gpu_bytes: int, t: PlanTarget) -> RolePlan:
    """``role`` on ``dp x cp`` with pools filling what the GPU has left: the most sequences of
    ``context_len`` tokens that fit with their activations (logits rows; the scheduler's token
    budget is at least ``max_num_seqs``), in whole MiB of cache budget."""
    problems = _check(cfg, role, dp, cp, t)
    block, slot = pool_unit_bytes(cfg, t.itemsize, t.tokens_per_block, cp)
    per_seq = slot + num_local_blocks(t.context_len, t.tokens_per_block, 0, cp) * block
    empty = PoolBytes(block, slot, 0, 0, scratch_slots=1)

    def with_sequences(n: int) -> RolePlan | None:
        """The plan holding ``n`` sequences with the smallest whole-MiB budget, if it fits."""
        budget_mib = -(-(n * per_seq) // MIB)
        num_blocks, num_slots = pools_from_budget(block, slot, budget_mib * MIB, n)
        memory = _memory(cfg, role, dp, cp, gpu_bytes, t, PoolBytes(block, slot, num_blocks, num_slots, 1), n)
        if not memory.fits:
            return None
        return RolePlan(memory, memory.pools.sequences_at(t.context_len, t.tokens_per_block, cp),
                        t.sequences_needed(role), budget_mib, n, problems)

    low, high = 0, gpu_bytes // max(1, per_seq)  # with_sequences(high + 1) cannot fit
    while low < high:  # the largest n that fits (fitting is monotone in n)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if with_sequences(mid) is not None else (low, mid - 1)
    if low == 0:
        return RolePlan(_memory(cfg, role, dp, cp, gpu_bytes, t, empty, 1), 0, t.sequences_needed(role), 0, 0,
                        problems)
    best = with_sequences(low)
    assert best is not None
    return best


def mappings(cfg: KimiModelConfig, role: str, world_size: int) -> list[tuple[int, int]]:
    """The ``(dp, cp)`` of ``world_size`` ranks the model can be laid out on for ``role``."""
    cps = [world_size] if role == "ctx" else [c for c in range(1, world_size + 1) if world_size % c == 0]
    return [(world_size // c, c) for c in cps
            if world_size == 1 or not cfg.helix_mapping_problems(world_size // c, c)]


def smallest_mapping(cfg: KimiModelConfig, role: str, gpu_bytes: int, t: PlanTarget,
                    max_world_size: int = MAX_WORLD_SIZE) -> RolePlan | None:
    """The plan with the fewest GPUs that fits (``None``: none up to ``max_world_size``); among
    mappings of that many GPUs, the one holding the most sequences, then the smaller ``cp``."""
    for n in range(1, max_world_size + 1):
        if n > 1 and cfg.moe_layer_ids and cfg.num_experts % n:
            continue  # experts are partitioned over the whole world
        fitting = [p for dp, cp in mappings(cfg, role, n) if (p := plan_filled(cfg, role, dp, cp, gpu_bytes, t)).fits]
        if fitting:
            return max(fitting, key=lambda p: (p.sequences, -p.memory.cp))
    return None


def ctx_layouts(cfg: KimiModelConfig, gpu_bytes: int, t: PlanTarget, max_tp: int = MAX_WORLD_SIZE) -> list[RolePlan]:
    """Every ctx world the model can be laid out on (``tp`` ranks, ep = tp: heads and experts
    divide), ascending, each with pools filling what its GPUs have left (``fits`` says whether
    its shard fits); a smaller ``tp`` than the first that fits is listed to show the shortfall."""
    return [plan_filled(cfg, "ctx", 1, tp, gpu_bytes, t) for tp in range(1, max_tp + 1)
            if tp == 1 or not cfg.helix_mapping_problems(1, tp)]
