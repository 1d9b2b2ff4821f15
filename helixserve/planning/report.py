"""``helixserve plan``: the plans as one JSON object or a table (torch-free).

JSON (``--json``): ``ctx_gpus`` / ``gen_gpus`` (the smallest mappings' GPU counts, ``null`` when
none fits), ``ctx_tp`` (the smallest ctx world whose shard fits: ``ctx[].tp`` to configure),
``roles.{ctx,gen}`` (that mapping, per-GPU bytes, sequences at the context length, the cache
settings to configure), ``ctx_layouts`` (every ctx world the model can be laid out on, ``tp`` =
``ep``, and whether its shard fits), and with ``-c CONFIG`` ``config.{ctx,gen}``: the config's own
mappings (its first ctx worker's ``tp``, its first gen worker's ``dp x cp``) with its cache
settings, sized as the servers size them. With speculative decoding (the config's per-role
``speculative`` sections, or ``--speculative``), ``speculative.{ctx,gen}`` names each role's method
and each role's ``drafter`` its model drafter's bytes on the rank that holds it (counted in
``per_rank`` too): ``null`` without one (no speculation, or ``ngram``: no weights, no pools).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from helixserve.config import CacheConfig, DeploymentConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.dtypes import MODEL_DTYPES, check_dtype, itemsize
from helixserve.models.config import KimiModelConfig
from helixserve.planning.drafter import resolve_drafter
from helixserve.planning.memory import GIB, RankMemory
from helixserve.planning.plan import ROLES, PlanTarget, RolePlan, ctx_layouts, plan_configured, smallest_mapping
from helixserve.planning.report_drafter import drafter_json, drafter_table, role_speculative, speculative_from_args


CTX_WORLD_NOTE = ("one GPU cannot hold the model: run each ctx worker as a ctx world of this many "
                  "ranks (ctx[].tp, ep = tp); each rank sends its own shard of the KV to gen")


def role_json(plan: RolePlan | None, t: PlanTarget) -> dict[str, Any] | None:
    if plan is None:
        return None
    m: RankMemory = plan.memory
    w = m.weights
    return {
        "dp": m.dp, "cp": m.cp, "ep": m.dp * m.cp,
        **({"tp": m.cp} if m.role == "ctx" else {}),  # a ctx world: ctx[].tp (the helix layout dp 1 x cp tp)
        "num_gpus": plan.num_gpus, "fits": plan.fits,
        "sequences_at_context": plan.sequences, "sequences_per_group": plan.sequences_per_group,
        "sequences_needed": plan.sequences_needed, "problems": list(plan.problems),
        "per_rank": {
            "weights_bytes": w.total_bytes, "weights_dense_bytes": w.dense_bytes, "weights_fp32_bytes": w.fp32_bytes,
            "weights_routed_experts_bytes": w.expert_bytes, "routed_expert_format": w.expert_format,
            "params": dict(w.params),
            "pool_bytes": m.pools.total_bytes, "num_blocks": m.pools.num_blocks, "num_slots": m.pools.num_slots,
            "block_bytes": m.pools.block_bytes, "slot_bytes": m.pools.slot_bytes,
            "activation_bytes": m.activation_bytes, "cuda_graph_bytes": m.graph_bytes,
            "total_bytes": m.total_bytes, "shortfall_bytes": m.shortfall_bytes,
        },
        "cache_config": {"memory_budget_mib": plan.memory_budget_mib, "max_num_seqs": plan.max_num_seqs,
                         **({"max_model_len": plan.max_model_len} if plan.max_model_len is not None else {})},
        "drafter": drafter_json(plan, t.context_len, t.tokens_per_block),
    }


def build_plan(cfg: KimiModelConfig, name: str, gpu_memory_gib: float, t: PlanTarget,
               configured: dict[str, tuple[int, int, CacheConfig]] | None = None,
               speculative: dict[str, SpeculativeConfig | None] | None = None) -> dict[str, Any]:
    """The JSON object; ``configured``: role -> (dp, cp, cache settings); ``speculative``: role ->
    its speculative decoding (its drafter read and checked here, against the role's cache settings
    when configured)."""
    gpu_bytes = int(gpu_memory_gib * GIB)
    speculative = speculative or {}
    caches = {role: c[2] for role, c in (configured or {}).items()}
    drafters = {role: resolve_drafter(speculative.get(role), cfg, caches.get(role, CacheConfig())) for role in ROLES}
    best = {role: smallest_mapping(cfg, role, gpu_bytes, t, drafter=drafters[role]) for role in ROLES}
    out: dict[str, Any] = {
        "model": name, "gpu_memory_gib": float(gpu_memory_gib), "context_len": t.context_len, "batch": t.batch,
        "ctx_batch": t.ctx_batch, "tokens_per_block": t.tokens_per_block,
        "max_num_batched_tokens": t.max_num_batched_tokens, "bytes_per_value": t.itemsize,
        "ctx_gpus": best["ctx"].num_gpus if best["ctx"] else None,
        "gen_gpus": best["gen"].num_gpus if best["gen"] else None,
        "ctx_tp": best["ctx"].memory.cp if best["ctx"] else None,
        "speculative": {role: role_speculative(speculative.get(role)) for role in ROLES},
        "roles": {role: role_json(plan, t) for role, plan in best.items()},
        "ctx_layouts": [{"tp": p.memory.cp, "ep": p.memory.cp, "fits": p.fits, "total_bytes": p.memory.total_bytes,
                         "shortfall_bytes": p.memory.shortfall_bytes, "sequences_at_context": p.sequences,
                         "problems": list(p.problems)}
                        for p in ctx_layouts(cfg, gpu_bytes, t, drafter=drafters["ctx"])],
    }
    ctx = best["ctx"]
    if ctx is not None and ctx.num_gpus > 1:
        out["roles"]["ctx"]["note"] = CTX_WORLD_NOTE
    if configured:
        out["config"] = {role: role_json(plan_configured(cfg, role, dp, cp, gpu_bytes, t, cache, drafters[role]), t)
                         for role, (dp, cp, cache) in configured.items()}
    return out


def _g(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f}"


def table(plan: dict[str, Any]) -> str:
    """The plan as a Markdown table (docs/deployment.md shows it)."""
    lines = [f"{plan['model']} on {plan['gpu_memory_gib']:g} GiB GPUs: {plan['context_len']:,}-token context, "
             f"batch {plan['batch']} (gen) / {plan['ctx_batch']} (ctx); GiB per GPU",
             "",
             "| role | layout | GPUs | weights (dense + fp32 + experts) | KV/state pools | activations | graphs "
             "| total | seqs at context | fits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    sections = [("", plan["roles"])] + ([("config ", plan["config"])] if "config" in plan else [])
    for prefix, roles in sections:
        for role in ROLES:
            r = roles.get(role)
            if r is None:
                if role in roles:
                    lines.append(f"| {prefix}{role} | none up to the largest world | - | - | - | - | - | - | - | no |")
                continue
            p = r["per_rank"]
            weights = (f"{_g(p['weights_bytes'])} ({_g(p['weights_dense_bytes'])} + {_g(p['weights_fp32_bytes'])} "
                       f"+ {_g(p['weights_routed_experts_bytes'])} {p['routed_expert_format']})")
            layout = f"tp {r['cp']} (ep {r['ep']})" if role == "ctx" else f"dp {r['dp']} x cp {r['cp']}"
            lines.append(
                f"| {prefix}{role} | {layout} | {r['num_gpus']} | {weights} | {_g(p['pool_bytes'])} "
                f"| {_g(p['activation_bytes'])} | {_g(p['cuda_graph_bytes'])} | {_g(p['total_bytes'])} "
                f"| {r['sequences_at_context']} | {'yes' if r['fits'] else 'no'} |")
    if plan["roles"].get("ctx") and plan["roles"]["ctx"].get("note"):
        lines += ["", f"ctx: {plan['roles']['ctx']['note']}."]
    return "\n".join(lines + drafter_table(plan, sections) + ctx_layouts_table(plan["ctx_layouts"]))


def ctx_layouts_table(layouts: list[dict[str, Any]]) -> list[str]:
    """The launchable ctx worlds: every ``tp`` the model's heads and experts divide (ep = tp)."""
    lines = ["", "ctx layouts the model divides over (ctx[].tp, ep = tp; the helix layout dp 1 x cp tp), "
             "GiB per GPU: a layout launches where its shard fits", "",
             "| tp | ep | total | short by | seqs at context | fits |", "|---|---|---|---|---|---|"]
    for c in layouts:
        short = _g(c["shortfall_bytes"]) if c["shortfall_bytes"] else "-"
        lines.append(f"| {c['tp']} | {c['ep']} | {_g(c['total_bytes'])} | {short} | {c['sequences_at_context']} "
                     f"| {'yes' if c['fits'] else 'no'} |")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``helixserve plan`` from its parsed arguments (see :func:`add_arguments`)."""
    configured = None
    t_kwargs: dict[str, Any] = {}
    gpu_gib = args.gpu_memory_gib
    speculative: dict[str, SpeculativeConfig | None] = {}
    if args.config:
        deploy = DeploymentConfig.from_yaml(args.config)
        cache, gen = deploy.cache, deploy.gen[0]
        speculative = {"ctx": deploy.ctx[0].speculative, "gen": gen.speculative}
        gpu_gib = gpu_gib if gpu_gib is not None else cache.gpu_memory_gib
        t_kwargs = {"tokens_per_block": cache.tokens_per_block,
                    "max_num_batched_tokens": deploy.scheduler.max_num_batched_tokens}
        configured = {"ctx": (1, deploy.ctx[0].tp, cache), "gen": (gen.dp, gen.cp, cache)}
        model_dir = args.model or (None if args.preset else deploy.model.path)
    else:
        model_dir = args.model
    if args.preset:
        from helixserve.models.presets import get_preset

        cfg, name = get_preset(args.preset), args.preset
    elif model_dir:
        cfg, name = KimiModelConfig.from_pretrained(model_dir), Path(model_dir).name
    else:
        raise ValueError("give --preset NAME, --model DIR or -c CONFIG")
    if gpu_gib is None:
        raise ValueError("give --gpu-memory-gib (or cache.gpu_memory_gib in the config)")
    if gpu_gib <= 0 or args.context_len < 1 or args.batch < 1 or args.ctx_batch < 1:
        raise ValueError("--gpu-memory-gib, --context-len, --batch and --ctx-batch must be positive")
    t_kwargs.setdefault("tokens_per_block", args.tokens_per_block)
    t_kwargs.setdefault("max_num_batched_tokens", args.max_num_batched_tokens)
    target = PlanTarget(context_len=args.context_len, batch=args.batch, ctx_batch=args.ctx_batch,
                        itemsize=itemsize(check_dtype(args.dtype, MODEL_DTYPES)), **t_kwargs)
    return build_plan(cfg, name, gpu_gib, target, configured, speculative_from_args(args) or speculative)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a named model config (kimi-k3, kimi-linear-48b, ...)")
    src.add_argument("--model", help="checkpoint directory (its config.json)")
    p.add_argument("-c", "--config", help="deployment YAML: plan its mappings and cache settings too")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU, GiB")
    p.add_argument("--context-len", type=int, default=32768, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences decoding at once on the gen world")
    p.add_argument("--ctx-batch", type=int, default=1, help="prefilled sequences a ctx worker holds at once")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="bfloat16")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--speculative", choices=["ngram", "draft", "hidden"], default=None,
                   help="count speculative decoding's drafter (replaces the config's speculative sections): a "
                        "draft model on gen (draft), a hidden-state drafter on ctx and gen (hidden; the ctx builds "
                        "its prompt cache); ngram costs nothing")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="--speculative draft or hidden: the drafter checkpoint (its config.json is read)")
    p.add_argument("--draft-tensor-parallel-size", type=int, default=1, metavar="N",
                   help="--speculative draft or hidden: 1 holds the drafter on each CP group's leader, the gen cp "
                        "splits its heads over the group (speculative.draft_tensor_parallel_size)")
