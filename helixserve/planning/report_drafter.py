"""``helixserve plan``'s speculative decoding: which drafter each role runs (from ``--speculative``
or the config's per-role sections) and what it costs, as JSON and as table lines (torch-free)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from helixserve.config_speculative import SpeculativeConfig
from helixserve.kvcache.helix import num_local_blocks
from helixserve.planning.memory import gib
from helixserve.planning.plan import ROLES, RolePlan

METHOD_NAMES = {"ngram": "ngram (prompt lookup)", "draft": "draft model", "hidden": "hidden-state drafter"}


def speculative_from_args(args: argparse.Namespace) -> dict[str, SpeculativeConfig | None] | None:
    """Each role's speculative decoding from ``--speculative`` (``None``: not given): the gen
    role's, and a ctx worker's too for a hidden drafter (the ctx builds its prompt cache)."""
    if args.speculative is None:
        given = [flag for flag, value in (("--draft-model", args.draft_model),
                                          ("--draft-tensor-parallel-size", args.draft_tensor_parallel_size != 1))
                 if value]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --speculative draft or hidden")
        return None
    spec = SpeculativeConfig(method=args.speculative, draft_model=args.draft_model,
                             draft_tensor_parallel_size=args.draft_tensor_parallel_size)
    ctx = spec.model_copy(update={"draft_tensor_parallel_size": 1})  # a ctx worker runs it in its one rank
    return {"ctx": ctx if spec.method == "hidden" else None, "gen": spec}


def role_speculative(spec: SpeculativeConfig | None) -> dict[str, Any] | None:
    """A role's speculative settings in the plan (``None``: no speculation)."""
    if spec is None:
        return None
    return {"method": spec.method, "draft_model": None if spec.draft_model is None else str(spec.draft_model),
            "draft_tensor_parallel_size": spec.draft_tensor_parallel_size}


def _held_on(plan: RolePlan) -> str:
    assert plan.drafter is not None
    if plan.num_gpus == 1:
        return "the one rank"
    if plan.drafter.tp > 1:
        return f"every rank (heads over {plan.drafter.tp})"
    return "CP rank 0 (each group's leader)"


def drafter_json(plan: RolePlan, context_len: int, tokens_per_block: int) -> dict[str, Any] | None:
    """The model drafter's bytes on the rank that holds it (``None``: none): its weights, its
    pools, and what one sequence of ``context_len`` tokens takes of them."""
    d = plan.drafter
    if d is None:
        return None
    m, pools = plan.memory, plan.memory.pools
    blocks = num_local_blocks(context_len, tokens_per_block, 0, m.cp) if pools.block_bytes else 0
    assert m.draft_weights is not None
    return {
        "method": d.method, "draft_model": str(d.path), "held_on": _held_on(plan), "tensor_parallel_size": d.tp,
        "weights_bytes": m.draft_weight_bytes, "params": dict(m.draft_weights.params),
        "pool_bytes": pools.draft_bytes, "block_bytes": pools.draft_block_bytes, "slot_bytes": pools.draft_slot_bytes,
        "feature_row_bytes": pools.draft_row_bytes,
        "bytes_per_sequence": blocks * pools.draft_block_bytes + pools.draft_slot_bytes + pools.draft_row_bytes,
    }


def drafter_table(plan: dict[str, Any], sections: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Lines naming each role's drafter and its cost (already in the table's totals); none
    without speculation."""
    lines = []
    for prefix, roles in sections:
        for role in ROLES:
            spec, r = plan["speculative"][role], roles.get(role)
            if spec is None or r is None:
                continue
            d = r["drafter"]
            if d is None:  # ngram
                lines.append(f"| {prefix}{role} | {METHOD_NAMES[spec['method']]} | - | none | none | none |")
                continue
            name = f"{METHOD_NAMES[d['method']]} {Path(d['draft_model']).name}"
            lines.append(f"| {prefix}{role} | {name} | {d['held_on']} | {gib(d['weights_bytes'])} "
                         f"| {gib(d['pool_bytes'])} | {gib(d['bytes_per_sequence'])} |")
    if not lines:
        return []
    return ["", "speculative decoding, counted above on the rank that holds the drafter (its pools come out of "
            "every rank's cache budget alike):", "",
            "| role | drafter | held on | weights | pools | per sequence at context |", "|---|---|---|---|---|---|",
            *lines]
