"""One rank's GPU memory: weights + KV/state pools + activations + CUDA-graph pools (torch-free).

- **Weights**: :func:`~helixserve.planning.weights.rank_weight_bytes` (format and sharding).
- **Pools** (:mod:`helixserve.kvcache.sizing`): ``num_blocks`` MLA latent pages and ``num_slots``
  KDA state slots, plus ``scratch_slots`` (one on CUDA: the padded CUDA-graph rows' slot) and,
  with prefix caching, ``checkpoint_slots`` KDA state checkpoints (a slot's size each). A rank
  of a CP group holds the blocks ``b % cp == cp_rank`` of each sequence (round-robin), so a
  sequence of ``L`` tokens needs ``ceil(ceil(L / tokens_per_block) / cp)`` blocks on CP rank 0
  (the fullest) and one slot on every rank.
- **Activations**: a stated bound, ``max_num_batched_tokens * hidden_size * ACTIVATION_FACTOR``
  values of the model dtype (the widest step: K3's MoE expands a token to top-k x 2 x 3072 =
  98,304 values, ~14 x hidden; its dense layer to 2 x 33,792; attention-residual banks hold 8 x
  hidden) plus fp32 logits and sampling buffers, ``2 x max_num_seqs x vocab x 4`` bytes.
- **CUDA graphs**: a stated allowance, ``CUDA_GRAPH_POOL_BYTES`` per GPU where decode steps are
  captured.
- **A model drafter** (speculative decoding, :mod:`helixserve.planning.drafter`) on the rank that
  holds it: its weights (``draft_weights``) and its pools beside the target's (``draft_*_bytes``
  of :class:`PoolBytes`: ``cp`` draft pages per block, a draft slot per slot, a hidden drafter's
  feature row per slot); every rank's budget counts them alike (:func:`engine_pool_sizes`).

The servers size their pools with :func:`engine_pool_sizes` (from ``cache.memory_budget_mib``)
and check the total with :meth:`RankMemory.check` before allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from helixserve.config import CacheConfig
from helixserve.kvcache.helix import num_local_blocks
from helixserve.kvcache.sizing import kda_slot_bytes, mla_block_bytes, pools_from_budget
from helixserve.models.config import KimiModelConfig
from helixserve.planning.weights import WeightBytes, rank_weight_bytes

MIB = 1 << 20
GIB = 1 << 30
ACTIVATION_FACTOR = 32
LOGITS_BUFFERS = 2
CUDA_GRAPH_POOL_BYTES = 1 * GIB


class DeploymentDoesNotFitError(ValueError):
    """A rank's weights, pools, activations and graph pools exceed its GPU memory; the message
    names every term and the shortfall (``shortfall_bytes``)."""

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


@dataclass(frozen=True, slots=True)
class PoolBytes:
    """One rank's cache pools: unit costs and counts; ``draft_*_bytes``: a model drafter's pools on
    the rank that holds it (a block's ``cp`` draft pages, a draft slot, a hidden drafter's feature
    row; the tensors of :mod:`helixserve.engine.draft_runner` and :mod:`helixserve.engine.hidden_runner`:
    draft slots beside the target's and its scratch slot, ``num_slots + 1`` feature rows)."""

    block_bytes: int
    slot_bytes: int
    num_blocks: int
    num_slots: int
    scratch_slots: int = 0
    checkpoint_slots: int = 0
    draft_block_bytes: int = 0
    draft_slot_bytes: int = 0
    draft_row_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        num_slots = self.num_slots + self.scratch_slots + self.checkpoint_slots
        return self.num_blocks * self.block_bytes + num_slots * self.slot_bytes + self.draft_bytes

    @property
    def draft_bytes(self) -> int:
        """The drafter's pools (0 without one)."""
        rows = self.num_slots + 1 if self.draft_row_bytes else 0
        return (self.num_blocks * self.draft_block_bytes + (self.num_slots + self.scratch_slots) * self.draft_slot_bytes
                + rows * self.draft_row_bytes)

    def sequences_at(self, context_len: int, tokens_per_block: int, cp: int) -> int:
        """Sequences of ``context_len`` tokens these pools hold at once (CP rank 0's share)."""
        blocks = num_local_blocks(context_len, tokens_per_block, 0, cp) if self.block_bytes else 0
        return min(self.num_slots, self.num_blocks // blocks) if blocks else self.num_slots


def pool_unit_bytes(cfg: KimiModelConfig, itemsize: int, tokens_per_block: int, cp: int = 1) -> tuple[int, int]:
    """``(block_bytes, slot_bytes)`` of a rank holding ``H / cp`` KDA heads."""
    block = mla_block_bytes(len(cfg.mla_layer_ids), tokens_per_block, cfg.mla_latent_dim, itemsize)
    slot = kda_slot_bytes(len(cfg.kda_layer_ids), cfg.kda_num_heads // cp, cfg.kda_head_dim, cfg.conv_kernel_size,
                          itemsize)
    return block, slot


CHECKPOINT_BUDGET_SHARE = 1 / 16  # of memory_budget_mib, for state checkpoints not sized by the config
MAX_AUTO_CHECKPOINTS = 32


def checkpoint_slot_count(cache: CacheConfig, slot_bytes: int) -> int:
    """The KDA state checkpoints a rank holds: none without prefix caching or KDA state (a
    ``slot_bytes`` of 0), ``cache.state_checkpoint_slots`` when set, else as many state slots as fit
    in :data:`CHECKPOINT_BUDGET_SHARE` of ``cache.memory_budget_mib`` (at least 1, at most
    :data:`MAX_AUTO_CHECKPOINTS`)."""
    if not cache.prefix_caching or slot_bytes == 0:
        return 0
    if cache.state_checkpoint_slots is not None:
        return cache.state_checkpoint_slots
    share = int(cache.memory_budget_mib * MIB * CHECKPOINT_BUDGET_SHARE) // slot_bytes
    return max(1, min(MAX_AUTO_CHECKPOINTS, share))


def engine_pool_sizes(cfg: KimiModelConfig, itemsize: int, tokens_per_block: int, memory_budget_mib: float,
                      max_num_seqs: int, cp: int = 1, num_checkpoint_slots: int = 0,
                      draft: KimiModelConfig | None = None, draft_tp: int = 1,
                      draft_slot_bytes: int = 0) -> tuple[int, int]:
    """``(num_blocks, num_slots)`` the engine allocates for ``cache.memory_budget_mib`` (after
    ``num_checkpoint_slots`` KDA state checkpoints). With a ``draft`` model (speculative decoding)
    a block and a slot cost the target's plus the draft's (:func:`draft_unit_bytes`), a slot
    ``draft_slot_bytes`` more (a hidden drafter's feature row of a prompt's last position)."""
    block, slot = budget_unit_bytes(cfg, itemsize, tokens_per_block, cp, draft, draft_tp, draft_slot_bytes)
    return pools_from_budget(block, slot, int(memory_budget_mib * MIB), max_num_seqs, num_checkpoint_slots)


def budget_unit_bytes(cfg: KimiModelConfig, itemsize: int, tokens_per_block: int, cp: int = 1,
                      draft: KimiModelConfig | None = None, draft_tp: int = 1,
                      draft_slot_bytes: int = 0) -> tuple[int, int]:
    """``(block_bytes, slot_bytes)`` the cache budget pays for one block and one slot: the
    target's, plus a ``draft`` model's (:func:`draft_unit_bytes`) and ``draft_slot_bytes``."""
    block, slot = pool_unit_bytes(cfg, itemsize, tokens_per_block, cp)
    if draft is not None:
        draft_block, draft_slot = draft_unit_bytes(draft, itemsize, tokens_per_block, cp, draft_tp)
        block, slot = block + draft_block, slot + draft_slot + draft_slot_bytes
    return block, slot


def draft_unit_bytes(draft: KimiModelConfig, itemsize: int, tokens_per_block: int, cp: int = 1,
                     draft_tp: int = 1) -> tuple[int, int]:
    """What one block and one slot of a rank's pools add for a ``draft`` model: its pools share
    the target's ids on full rows, ``cp`` draft pages per block of one rank (a rank that runs the
    draft holds the group's every block, :mod:`helixserve.engine.draft_runner`: the MLA latent is
    head-independent, so heads TP does not split it) and one draft slot per slot, of ``H /
    draft_tp`` KDA heads (``draft_tp``: the ranks its heads are split over, 1 on a leader alone).
    Every rank of a group counts them alike, so its capacity stays CP-uniform."""
    block, slot = pool_unit_bytes(draft, itemsize, tokens_per_block, draft_tp)
    return cp * block, slot


def activation_bytes(cfg: KimiModelConfig, itemsize: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The stated activation bound (module docstring)."""
    hidden = max_num_batched_tokens * cfg.hidden_size * ACTIVATION_FACTOR * itemsize
    return hidden + LOGITS_BUFFERS * max_num_seqs * cfg.vocab_size * 4


def rank_memory(cfg: KimiModelConfig, role: str, dp: int, cp: int, itemsize: int, pools: PoolBytes,
                max_num_batched_tokens: int, max_num_seqs: int, cuda_graphs: bool, gpu_bytes: int | None,
                expert_format: str | None = None, draft_weights: WeightBytes | None = None) -> RankMemory:
    """One rank's memory with these pools (the planner's and the engine's); ``draft_weights``: a
    model drafter's on this rank."""
    weights = rank_weight_bytes(cfg, itemsize, dp, cp, expert_format)
    activations = activation_bytes(cfg, itemsize, max_num_batched_tokens, max_num_seqs)
    return RankMemory(role, dp, cp, weights, pools, activations, CUDA_GRAPH_POOL_BYTES if cuda_graphs else 0,
                      gpu_bytes, draft_weights)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one GPU of a role holds; ``gpu_bytes`` ``None``: no limit known (CPU);
    ``draft_weights``: a model drafter's weights (``None``: none on this rank)."""

    role: str
    dp: int
    cp: int
    weights: WeightBytes
    pools: PoolBytes
    activation_bytes: int
    graph_bytes: int
    gpu_bytes: int | None
    draft_weights: WeightBytes | None = None

    @property
    def draft_weight_bytes(self) -> int:
        return 0 if self.draft_weights is None else self.draft_weights.total_bytes

    @property
    def total_bytes(self) -> int:
        return (self.weights.total_bytes + self.draft_weight_bytes + self.pools.total_bytes + self.activation_bytes
                + self.graph_bytes)

    @property
    def shortfall_bytes(self) -> int:
        return 0 if self.gpu_bytes is None else max(0, self.total_bytes - self.gpu_bytes)

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0

    def describe(self) -> str:
        w = self.weights
        draft = (f" + drafter weights {gib(self.draft_weight_bytes)}" if self.draft_weights is not None else "")
        draft_pools = f" (drafter's {gib(self.pools.draft_bytes)})" if self.pools.draft_bytes else ""
        return (f"weights {gib(w.total_bytes)} (dense {gib(w.dense_bytes)} + fp32 {gib(w.fp32_bytes)} + routed "
                f"experts {gib(w.expert_bytes)} as {w.expert_format}){draft} + KV/state pools "
                f"{gib(self.pools.total_bytes)}{draft_pools} + activations {gib(self.activation_bytes)} "
                f"+ CUDA graphs {gib(self.graph_bytes)} = {gib(self.total_bytes)}")

    def check(self) -> None:
        """Raise :class:`DeploymentDoesNotFitError` naming the shortfall when this does not fit."""
        if self.fits:
            return
        assert self.gpu_bytes is not None
        weights = self.weights.total_bytes + self.draft_weight_bytes
        what = ("the weights alone exceed the GPU memory" if weights > self.gpu_bytes
                else "lower cache.memory_budget_mib / max_num_seqs / max_num_batched_tokens, or shard over more GPUs")
        raise DeploymentDoesNotFitError(
            f"{self.role} rank (dp {self.dp} x cp {self.cp}) does not fit {gib(self.gpu_bytes)} of GPU memory: "
            f"{self.describe()}; short by {gib(self.shortfall_bytes)} ({what})", self.shortfall_bytes)


def gib(num_bytes: int) -> str:
    """``num_bytes`` for a message: GiB, MiB, or bytes when smaller."""
    if abs(num_bytes) >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / MIB:.1f} MiB" if abs(num_bytes) >= MIB else f"{num_bytes} B"
