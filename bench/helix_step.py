"""One decode step of a helix_a2a gen world: token-sliced MoE vs replicated MoE, same world, same run.

A world of dp x cp ranks (gloo on CPU; NCCL with one GPU per rank when ``--device cuda``) holds a
K3-style model with random weights (each rank materializes only its shard). Every CP group
decodes T sequences (one new token each, ``--context`` tokens of KV spread round-robin over the
group). The step is timed twice, alternating per repetition:

- ``sliced``: each CP rank routes only its ceil(T/cp) rows (helix_a2a);
- ``replicated``: each CP rank all-gathers and routes all T rows (every token dispatched cp times)
  and keeps its slice of the result (the baseline).

A step's time is the slowest rank's (median over repetitions); the phase breakdown comes from
separate repetitions with a synchronizing timer (rank 0). ``ratio = sliced / replicated``
(BENCHMARKS.md target: <= 0.9 at T >= 64 on GPUs).

``--static`` compares the static helix step instead (``HelixHooks.set_static``, what a CUDA graph
of a world step holds: padded MoE all-to-all, no host read) with the default host-split step, both
sliced: ``host``; ``static-T`` with capacity ceil(T / cp) (what a dp 1 world uses: each step's
exact capacity); ``static-B`` with the capacity of ``--budget B`` (a dp > 1 world's
``max_num_batched_tokens``: every step pays it). ``ratio = mode / host``, eager (on the CPU the padded path is expected
slower; its win is a captured step on GPUs).

    python bench/helix_step.py [--quick] [--out FILE] [--dp 1 --cp 2] [--tokens 8,64,512]
        [--device cpu|cuda] [--config cpu|gpu] [--override JSON] [--static [--budget 2048]]
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench helpers; the repo when not pip-installed
from _common import base_parser, machine_info, markdown_table, median, write_json  # noqa: E402

from helixserve.cache_layout import cache_spec_for  # noqa: E402
from helixserve.kvcache import CacheManager  # noqa: E402
from helixserve.kvcache.pools import allocate_model_caches  # noqa: E402
from helixserve.launch.processes import run_local_world  # noqa: E402
from helixserve.models.config import KimiModelConfig  # noqa: E402
from helixserve.models.context import ForwardBatch  # noqa: E402
from helixserve.models.helix_hooks import PhaseTimer  # noqa: E402
from helixserve.models.kimi import KimiForCausalLM  # noqa: E402
from helixserve.models.presets import PRESETS  # noqa: E402
from helixserve.parallel import Mapping, init_parallel  # noqa: E402

TPB = 16
# K3 layer kinds (layer 0 dense, then MoE; KDA + MLA; attention residuals; latent MoE; SiTU)
CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {
        **PRESETS["kimi-k3-tiny"], "hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1024,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "linear_attn_config": {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 512,
        "routed_expert_hidden_size": 256, "attn_res_block_size": 2, "routed_expert_format": "dense",
    },
    # K3 per-layer widths with fewer layers and experts, to fit 2 H200s
    "gpu": {
        **PRESETS["kimi-k3"], "num_hidden_layers": 4, "vocab_size": 32768,
        "linear_attn_config": {**PRESETS["kimi-k3"]["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        "num_experts": 64, "routed_expert_format": "dense",
    },
}


def _fill_random(model: torch.nn.Module, seed: int) -> None:
    """Per-name seeded values drawn on the parameter's device (replicated parameters agree across
    ranks), scaled for O(1) activations."""
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
        value = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if name.endswith("A_log"):
            value = torch.log(torch.rand(p.shape, generator=gen, device=p.device) * 15 + 1)
        elif name.endswith("dt_bias"):
            value = value * 0.01 - 4.0
        elif name.endswith("e_score_correction_bias"):
            value = value * 0.01
        elif p.dim() == 1:
            value = 1.0 + 0.1 * value
        else:
            value = value / p.shape[-1] ** 0.5
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def _decode_batch(manager: CacheManager, num_seqs: int, context: int, device: torch.device) -> ForwardBatch:
    tables, slots = [], []
    for i in range(num_seqs):
        handle = manager.allocate(f"s{i}", context + 1)
        tables.append(handle.block_table())
        slots.append(handle.slot)
    long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=long([(7 * i) % 256 for i in range(num_seqs)]), positions=long([context] * num_seqs),
        cu_seqlens=long(list(range(num_seqs + 1))), context_lens=long([context] * num_seqs),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device), state_slots=long(slots),
        logits_indices=long(list(range(num_seqs))),
    )


def _rank(rank: int, world_size: int, init_method: str, args: dict[str, Any]) -> dict[str, Any]:
    cuda = args["device"] == "cuda"
    mapping = Mapping(world_size, rank, dp=args["dp"], cp=args["cp"])
    groups = init_parallel(mapping, init_method, backend="nccl" if cuda else "gloo", local_rank=rank, timeout_s=300)
    device = groups.device
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = KimiModelConfig.model_validate({**CONFIGS[args["config"]], **args["override"]})
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype, mapping)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    _fill_random(model, seed=0)
    model.bind(groups)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"rows": []}
    for num_seqs in args["tokens"]:
        spec = cache_spec_for(cfg, dtype, TPB, kda_num_heads=model.kda_num_local_heads)
        blocks = num_seqs * (-(-(args["context"] + 1) // TPB) // mapping.cp + 1)
        caches = allocate_model_caches(spec, blocks, num_seqs, device)
        for pool in caches.mla_kv.values():
            pool.normal_()
        batch = _decode_batch(CacheManager(blocks, num_seqs, TPB, mapping.cp_rank, mapping.cp), num_seqs, args["context"], device)
        modes = _modes(args, num_seqs)
        times: dict[str, list[float]] = {name: [] for name in modes}
        phases: dict[str, dict[str, float]] = {}

        def use(name: str) -> None:  # static-B: B's capacity on every step (what dp > 1 pays)
            model.moe_mode, budget = modes[name]
            model.helix.set_static(budget, per_step=False if budget is not None else None)

        for rep in range(args["warmup"] + args["reps"]):
            for mode in modes:
                use(mode)
                torch.distributed.barrier(groups.cpu)
                sync()
                start = time.perf_counter()
                model(batch, caches)
                sync()
                if rep >= args["warmup"]:
                    times[mode].append(time.perf_counter() - start)
        for mode in modes:  # phase breakdown (synchronizing timer)
            use(mode)
            model.timer = PhaseTimer(device)
            for _ in range(max(1, args["reps"] // 2)):
                model(batch, caches)
            phases[mode] = {k: v / max(1, args["reps"] // 2) for k, v in model.timer.seconds.items()}
            model.timer = None
        out["rows"].append({"T": num_seqs, "times": times, "phases": phases})
    groups.destroy()
    return out


def _modes(args: dict[str, Any], num_seqs: int) -> dict[str, tuple[str, int | None]]:
    """name -> (moe_mode, static step budget or None)."""
    if not args["static"]:
        return {"sliced": ("sliced", None), "replicated": ("replicated", None)}
    return {"host": ("sliced", None), "static-T": ("sliced", num_seqs), f"static-{args['budget']}": ("sliced", args["budget"])}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tokens", default=None, help="comma-separated T values (default 8,64,512; quick 8,64)")
    parser.add_argument("--context", type=int, default=256, help="KV tokens per sequence")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None, help="default: cpu on CPU, gpu on CUDA")
    parser.add_argument("--override", type=json.loads, default={}, help="JSON dict of config fields to change")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    parser.add_argument("--static", action="store_true", help="static helix step vs host split (see above)")
    parser.add_argument("--budget", type=int, default=2048, help="--static: the world's step token budget")
    args = parser.parse_args()
    tokens = [int(t) for t in (args.tokens or ("8,64" if args.quick else "8,64,512")).split(",")]
    world = args.dp * args.cp
    opts = {"dp": args.dp, "cp": args.cp, "tokens": tokens, "context": args.context, "device": args.device,
            "config": args.config or ("gpu" if args.device == "cuda" else "cpu"), "override": args.override,
            "warmup": 1 if args.quick else 3, "reps": 3 if args.quick else 10, "static": args.static,
            "budget": args.budget}
    per_rank = run_local_world(_rank, world, opts, timeout_s=3600, num_threads=args.threads)
    table, rows = [], []
    for i, num_seqs in enumerate(tokens):
        modes = list(_modes(opts, num_seqs))
        step = {m: median([max(r["rows"][i]["times"][m][k] for r in per_rank)
                           for k in range(opts["reps"])]) for m in modes}
        phases = per_rank[0]["rows"][i]["phases"]
        for mode in modes:
            p = dict(phases[mode])
            p["moe_comm"] = p.get("moe_a2a", 0.0) - p.get("moe_experts", 0.0)
            if opts["static"]:  # mode / host
                ratio = None if mode == modes[0] else step[mode] / step[modes[0]]
            else:  # sliced / replicated, on the sliced row
                ratio = step["sliced"] / step["replicated"] if mode == "sliced" else None
            rows.append({"T": num_seqs, "mode": mode, "step_ms": step[mode] * 1e3, "ratio": ratio,
                         "phases_ms": {k: v * 1e3 for k, v in sorted(p.items())}})
            table.append([num_seqs, mode, step[mode] * 1e3,
                          *(p.get(k, 0.0) * 1e3 for k in ("kda", "mla_attend", "cp_lse_a2a", "cp_gather",
                                                           "cp_reduce_scatter", "moe_local", "moe_experts", "moe_comm")),
                          ratio])
    headers = ["T", "MoE", "step ms", "kda", "mla", "lse a2a", "gather", "red-scat", "moe local", "experts",
               "moe a2a", "mode/host" if opts["static"] else "sliced/repl"]
    print(f"dp={args.dp} cp={args.cp} device={args.device} config={opts['config']} context={args.context} "
          f"(phase columns: ms on rank 0, synchronizing timer; collective phases include waiting for the slower rank)")
    print(markdown_table(headers, table))
    write_json(args.out, {"bench": "helix_step", "machine": machine_info(), "options": opts, "rows": rows})


if __name__ == "__main__":
    main()
