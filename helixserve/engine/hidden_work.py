"""What a heads-TP hidden drafter's leader announces to its CP group (``speculative.method:
hidden``, ``draft_tensor_parallel_size`` = the world's ``cp``; :mod:`.hidden_runner`): each call
of the leader's drafter that runs drafter forwards or moves its per-request state, as data, so
that every rank of the group runs the same forwards on the same rows, in the same order, and keeps
the same state. The features a row reads are not sent: every rank of the group holds the target's
captured hidden states of the group's every row (:mod:`helixserve.models.hidden_capture`) and
keeps its own copy of each sequence's rows (:meth:`HiddenDraftRunner.record` after each target
forward, on every rank). Block tables are the drafter's full-row tables (the same on every rank).

A received prompt cache (disaggregated serving) arrives on the leader only; :func:`share_prompt_cache`
forwards it over the group's device group: the request's drafter pages of every drafter layer and
its feature row (``num_pages * tokens_per_block * (kv_lora_rank + qk_rope_head_dim) *
num_drafter_layers + feature_size`` values, :func:`prompt_cache_values`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.engine.scheduler_output import ScheduledSeq
from helixserve.parallel import ParallelGroups, broadcast_from


@dataclass(slots=True)
class HiddenStep:
    """A step's catch-up and draft forwards: the step's sequences (their block tables the
    drafter's full-row tables), and the requests the leader forgot since its last step."""

    seqs: list[ScheduledSeq]
    forgotten: list[str]


@dataclass(slots=True)
class HiddenPrompt:
    """A request started on a prompt cache from a ctx worker: ``num_tokens`` cached, the last one
    ``last_token``; ``received``: the drafter's cache of it came along (forwarded from the leader
    to the group), else its ``rows`` are written with zero features."""

    request_id: str
    num_tokens: int
    last_token: int
    slot: int | None
    block_table: list[int]
    received: bool
    rows: list[ScheduledSeq]


@dataclass(slots=True)
class HiddenHold:
    """Held prefills whose drafter cache is completed to travel: (request id, full-row table, slot)."""

    requests: list[tuple[str, list[int], int | None]]


HiddenWork = HiddenStep | HiddenPrompt | HiddenHold


def prompt_cache_values(caches: ModelCaches, num_pages: int, feature_size: int) -> int:
    """Values :func:`share_prompt_cache` moves for a request of ``num_pages`` drafter pages."""
    return sum(pool[0].numel() for pool in caches.mla_kv.values()) * num_pages + feature_size


def share_prompt_cache(groups: ParallelGroups, caches: ModelCaches, features: torch.Tensor,
                       block_table: list[int], slot: int) -> None:
    """The leader's drafter pages ``block_table`` (every drafter layer) and feature row ``slot``
    onto every rank of its CP group, in one broadcast (called on every rank alike; ``-1``
    entries, blocks not held, are skipped)."""
    block_table = [p for p in block_table if p >= 0]
    pools = list(caches.mla_kv.values())
    pages = torch.tensor(block_table, dtype=torch.long, device=features.device)
    parts = [pool.index_select(0, pages).flatten() for pool in pools] + [features[slot]]
    packed = torch.cat(parts)  # the leader's values; overwritten on the others
    mapping = groups.mapping
    broadcast_from(packed, mapping.rank_of(mapping.dp_rank, 0), groups.cp)
    if mapping.cp_rank == 0:
        return
    at = 0
    for pool in pools:
        n = len(block_table) * pool[0].numel()
        pool.index_copy_(0, pages, packed[at:at + n].view(len(block_table), *pool.shape[1:]))
        at += n
    features[slot].copy_(packed[at:])
