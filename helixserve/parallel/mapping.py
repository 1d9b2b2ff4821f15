"""Rank layout of a generation world: dp x cp x tp ranks, expert parallelism over all of them.

Layout (tp = 1 today, kept in the formulas so the order is explicit)::

    rank = (dp_rank * cp + cp_rank) * tp + tp_rank

so the ranks of one CP group are contiguous: with dp=2, cp=2 the CP groups are [0, 1] and [2, 3].

Vocabulary used across ``helixserve.parallel``:

- **CP group** (``cp_group_ranks``): the ranks that hold the *same requests* (the same T tokens in
  a step). It is the attention-DP unit: helix attention shards MLA KV along the sequence over it,
  KDA heads are sharded over it, and the residual stream / MoE run token-sliced over it.
  ``dp_rank`` is the index of this rank's CP group; the executor assigns requests to a ``dp_rank``.
- **DP group** (``dp_group_ranks``): the ranks with the same ``cp_rank`` (and ``tp_rank``) across
  the dp CP groups, in the Megatron sense. They hold *different* requests when ``attention_dp``.
- **EP group** (``ep_group_ranks``): the whole world; expert ``e`` lives on rank
  ``e // (num_experts // ep)``.

A draft model's mapping (``heads_tp``, :meth:`Mapping.for_draft_heads_tp`) is one CP group seen
alone (``world_size = cp``, ``dp = 1``): every rank runs every row, the attention heads are split
over the group (tensor parallel, o_proj row-parallel + an all-reduce), and experts, embedding and
LM head are replicated (``local_experts`` is every expert).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Mapping:
    """Where one rank sits in a ``dp x cp x tp`` generation world.

    Attributes:
        world_size: number of ranks, must equal ``dp * cp * tp``.
        rank: this rank, ``0 <= rank < world_size``.
        dp: number of CP groups (attention-DP groups).
        cp: ranks per CP group (helix context parallelism).
        tp: tensor parallelism; only ``tp == 1`` is supported.
        ep: expert parallelism; ``None`` means ``world_size`` (the only supported value).
        attention_dp: whether different CP groups hold different requests; ``None`` means
            ``dp > 1``.
        heads_tp: a draft model's mapping over one CP group (see the module docstring); needs
            ``dp == 1``.
    """

    world_size: int
    rank: int = 0
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int | None = None
    attention_dp: bool | None = None
    heads_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "cp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mapping.{name}={value!r} must be a positive int")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping.rank={self.rank!r} is outside [0, world_size={self.world_size})")
        if self.tp != 1:
            raise ValueError(f"Mapping.tp={self.tp} is not supported: helix_a2a runs with tp=1")
        if self.dp * self.cp * self.tp != self.world_size:
            raise ValueError(
                f"Mapping: dp={self.dp} * cp={self.cp} * tp={self.tp} = "
                f"{self.dp * self.cp * self.tp} != world_size={self.world_size}"
            )
        if self.ep is None:
            object.__setattr__(self, "ep", self.world_size)
        elif self.ep != self.world_size:
            raise ValueError(
                f"Mapping.ep={self.ep} != world_size={self.world_size}: helix_a2a runs expert "
                "parallelism over the whole world"
            )
        if self.attention_dp is None:
            object.__setattr__(self, "attention_dp", self.dp > 1)
        if self.heads_tp and self.dp != 1:
            raise ValueError(f"Mapping.heads_tp (a draft model's mapping over one CP group) needs dp=1, got dp={self.dp}")

    def for_draft_heads_tp(self) -> Mapping:
        """This rank's place in its CP group's heads-TP draft model (see the module docstring)."""
        return Mapping(self.cp, self.cp_rank, dp=1, cp=self.cp, heads_tp=True)

    # ---- this rank's coordinates
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    @property
    def ep_rank(self) -> int:
        return self.rank

    @property
    def is_cp_leader(self) -> bool:
        """True on cp_rank 0 (e.g. the rank that reports a CP group's results)."""
        return self.cp_rank == 0

    # ---- groups (global rank ids, ascending)
    def rank_of(self, dp_rank: int, cp_rank: int, tp_rank: int = 0) -> int:
        """Global rank of the given coordinates."""
        if not (0 <= dp_rank < self.dp and 0 <= cp_rank < self.cp and 0 <= tp_rank < self.tp):
            raise ValueError(
                f"coordinates dp_rank={dp_rank}, cp_rank={cp_rank}, tp_rank={tp_rank} outside "
                f"dp={self.dp}, cp={self.cp}, tp={self.tp}"
            )
        return (dp_rank * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def cp_group_ranks(self) -> list[int]:
        """Ranks of this rank's CP group (they share requests): contiguous."""
        return [self.rank_of(self.dp_rank, c, self.tp_rank) for c in range(self.cp)]

    @property
    def dp_group_ranks(self) -> list[int]:
        """Ranks with this rank's cp_rank and tp_rank in every CP group."""
        return [self.rank_of(d, self.cp_rank, self.tp_rank) for d in range(self.dp)]

    @property
    def tp_group_ranks(self) -> list[int]:
        return [self.rank_of(self.dp_rank, self.cp_rank, t) for t in range(self.tp)]

    @property
    def ep_group_ranks(self) -> list[int]:
        return list(range(self.world_size))

    def all_cp_groups(self) -> list[list[int]]:
        """Every CP group, in dp_rank order (the order every rank creates them in)."""
        return [[self.rank_of(d, c, t) for c in range(self.cp)] for d in range(self.dp) for t in range(self.tp)]

    def all_dp_groups(self) -> list[list[int]]:
        """Every DP group, in (cp_rank, tp_rank) order."""
        return [[self.rank_of(d, c, t) for d in range(self.dp)] for c in range(self.cp) for t in range(self.tp)]

    @property
    def tp_group_shares_requests(self) -> bool:
        """True when every rank of this rank's TP group holds the same requests.

        Always True here: attention DP splits requests across CP groups, never inside a TP group
        (and tp == 1). Modules that would shard rows over TP under attention DP check this.
        """
        return True

    # ---- sharding
    def local_heads(self, num_heads: int) -> range:
        """Heads this rank owns when heads are sharded over the CP group (KDA, MLA value heads).

        Rank with cp_rank r owns heads ``[r * H / cp, (r + 1) * H / cp)``.
        """
        if num_heads < 1 or num_heads % self.cp != 0:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by cp={self.cp}: heads are sharded over "
                "the CP group"
            )
        per_rank = num_heads // self.cp
        return range(self.cp_rank * per_rank, (self.cp_rank + 1) * per_rank)

    def local_experts(self, num_experts: int) -> range:
        """Experts this rank owns (contiguous): ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``;
        every expert under ``heads_tp``."""
        assert self.ep is not None
        if self.heads_tp:
            return range(num_experts)
        if num_experts < 1 or num_experts % self.ep != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep={self.ep} (world size): experts "
                "are partitioned over the whole world"
            )
        per_rank = num_experts // self.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def local_vocab(self, vocab_size: int) -> range:
        """Vocabulary rows of the embedding / LM head on this rank: sharded over tp (= full)."""
        if vocab_size < 1 or vocab_size % self.tp != 0:
            raise ValueError(f"vocab_size={vocab_size} is not divisible by tp={self.tp}")
        per_rank = vocab_size // self.tp
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    def mapping_for_full_rows(self) -> Mapping:
        """The view used by modules that run on all T rows, replicated on every CP rank.

        Full-row modules (embedding, layer-0 dense MLP, final norm, LM head) shard neither heads,
        vocabulary nor rows: in this view ``cp == 1`` and every rank is its own replica
        (``dp == world_size``), so ``local_heads(H) == range(H)`` and
        ``local_vocab(V) == range(V)``. ``rank``, ``ep`` and ``attention_dp`` are unchanged;
        note that replicas of one original CP group still hold the same rows.
        """
        return replace(self, dp=self.world_size // self.tp, cp=1, heads_tp=False)
