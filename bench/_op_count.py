"""Device kernels a batch-1 decode step launches, counted on the CPU (a proxy for the GPU's count).

The models have the layer structure of ``kimi-k3-mid`` and ``kimi-linear-48b`` (layer counts and
kinds, expert counts and top-k, MLA q-LoRA / output gate, KDA gates, SiTU, latent MoE, attention
residuals) at tiny widths, in bf16 as the GPU runs them and unpacked as on the GPU. One decode step
(``is_decode``, logits of the CUDA graph's rows) runs under ``torch.profiler`` on the CUDA code
path: the kernels' device checks answer "CUDA" (``use_triton`` / ``use_fla`` / ``on_device``), our
Triton kernels run in Triton's interpreter and each launch counts as one kernel; fla's recurrent
KDA step and the MLA decode attention are stand-ins that count their launches (1 and 2) and run
the PyTorch reference. Every other operator is counted once where it would launch a device kernel:
views and other metadata-only operators count nothing (unless they copy), an operator that copies
counts once (``_to_copy`` a cast, ``clone`` a ``.contiguous()`` or a copying reshape), and a
composite operator counts once at its outermost call (``linear``, ``rms_norm``).

What differs from the GPU: cuBLAS may split a GEMM in two kernels, sort and top-k may launch a few,
FlashMLA (when built) launches ~4 kernels against the Triton path's 2.

    python bench/_op_count.py [--quick] [--out FILE] [--baseline REF]

``--baseline REF`` counts the same models on the package as it was at git ``REF`` (in a child
process, same counting code) and prints both with their ratio.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (it reads it at import)
_INTERP = os.environ.get("HELIXSERVE_TRITON_INTERP", str(Path(sys.prefix) / "triton-interp"))
if (Path(_INTERP) / "triton").is_dir() and _INTERP not in sys.path:
    sys.path.insert(0, _INTERP)

import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, markdown_table, write_json  # noqa: E402

# operators that launch nothing unless a child copies
METADATA = frozenset((
    "view", "reshape", "_reshape_alias", "as_strided", "expand", "expand_as", "unsqueeze", "squeeze", "select",
    "slice", "t", "transpose", "permute", "_unsafe_view", "detach", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "split", "split_with_sizes", "chunk", "unbind", "narrow", "alias",
    "view_as", "flatten", "unflatten", "to", "contiguous", "lift_fresh", "resolve_conj", "resolve_neg",
    "result_type", "numel", "size", "stride", "movedim", "diagonal", "_has_compatible_shallow_copy_type",
    "is_nonzero", "type_as", "_local_scalar_dense", "item", "dim", "is_same_size", "lift_fresh_copy",
    "promote_types", "can_cast",
))
HOST_READS = frozenset(("_local_scalar_dense", "item", "is_nonzero"))
# (phase, operator names); first match wins; triton:: / stub:: launches are "fused"
PHASES: tuple[tuple[str, frozenset[str]], ...] = (
    ("gemm", frozenset(("linear", "mm", "bmm", "matmul", "addmm", "_grouped_mm", "baddbmm", "einsum"))),
    ("casts", frozenset(("_to_copy",))),
    ("copies", frozenset(("copy_", "clone", "cat", "stack", "index", "index_select", "index_copy_", "index_put_",
                          "gather", "scatter", "scatter_", "embedding", "fill_", "zero_", "zeros", "zeros_like",
                          "new_zeros", "full", "ones", "arange", "repeat", "repeat_interleave", "where"))),
    ("norm", frozenset(("rms_norm", "layer_norm", "_fused_rms_norm"))),
    ("sort/topk", frozenset(("topk", "sort", "argsort", "searchsorted"))),
)


def phase_of(op: str) -> str:
    if op.startswith(("triton::", "stub::")):
        return "fused"
    for phase, names in PHASES:
        if op in names:
            return phase
    return "elementwise"


def tiny_config(preset: str) -> Any:
    """``preset`` with its layer structure and tiny widths."""
    from helixserve.models.config import KimiModelConfig
    from helixserve.models.presets import PRESETS

    raw = dict(PRESETS[preset])
    lin = dict(raw["linear_attn_config"], num_heads=4, head_dim=16)
    raw.update(
        vocab_size=512, bos_token_id=256, eos_token_id=257, pad_token_id=258, max_position_embeddings=4096,
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
        linear_attn_config=lin, routed_expert_format="dense",
    )
    if raw.get("q_lora_rank") is not None:
        raw["q_lora_rank"] = 32
    if raw.get("routed_expert_hidden_size") is not None:
        raw["routed_expert_hidden_size"] = 32
    return KimiModelConfig.model_validate(raw)


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """The kernels take their CUDA branches on CPU tensors (see module docstring), undone on exit."""
    import helixserve.kernels as kernels_pkg
    from helixserve.kernels.kda import gpu as kda_gpu
    from helixserve.kernels.kda import recurrent as kda_recurrent
    from helixserve.kernels.mla import paged as mla_paged

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for name, module in list(sys.modules.items()):
        if name.startswith("helixserve.kernels"):
            for attr in ("use_triton", "use_fla", "on_device"):
                if callable(getattr(module, attr, None)):
                    patch(module, attr, lambda *_: True)

    def recurrent_stub(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm):  # noqa: ANN001, ANN202
        with record_function("stub::fla_fused_recurrent_kda"):
            return kda_recurrent._recurrent_step_torch(q, k, v, g, beta, state_pool, slot_ids, scale, use_qk_l2norm)

    reference_attention = kernels_pkg.mla_paged_attention

    def attention_stub(*args: Any, **kwargs: Any) -> Any:
        with record_function("stub::mla_decode_split"), record_function("stub::mla_decode_combine"):
            return reference_attention(*args, **kwargs)

    experts = sys.modules["helixserve.kernels.moe.experts"]
    if not hasattr(experts, "on_device"):  # a package (a --baseline ref) that tests x.is_cuda: its CUDA branch
        from helixserve.kernels.moe import gpu as moe_gpu

        def moe_experts(x, topk_ids, topk_weights, w13, w2, *, expert_offset=0, activation="silu",  # noqa: ANN001, ANN202
                        situ_beta=4.0, situ_linear_beta=25.0):
            def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
                return experts._act_and_mul_torch(gate, up, activation, situ_beta, situ_linear_beta)

            return moe_gpu.grouped_experts(x, topk_ids, topk_weights, w13, w2, expert_offset, act)

        patch(kernels_pkg, "moe_experts", moe_experts)
    patch(kda_gpu, "recurrent_step", recurrent_stub)
    patch(kernels_pkg, "mla_paged_attention", attention_stub)
    patch(mla_paged, "_fast_path", lambda *_: False)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _interpreted_launches() -> contextlib.AbstractContextManager:
    """Each Triton launch recorded as ``triton::<kernel>`` (its interpreted ops are not counted),
    with the interpreter patches the kernel tests use (``tests._testing.triton_interpreter_patches``:
    numpy 2 scalars as loop bounds, autotuned kernels run their first config)."""
    import numpy as np
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    run, patch_lang_tensor, autotune_run = (interpreter.InterpretedFunction.run, interpreter._patch_lang_tensor,
                                            autotuner.Autotuner.run)

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with record_function(f"triton::{self.fn.__name__}"):
            return run(self, *args, **kwargs)

    def patched_lang_tensor(tensor: Any, scope: Any) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def first_config_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.configs = self.configs[:1]
        return autotune_run(self, *args, **kwargs)

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        interpreter.InterpretedFunction.run = counted_run
        interpreter._patch_lang_tensor = patched_lang_tensor
        autotuner.Autotuner.run = first_config_run
        try:
            yield
        finally:
            interpreter.InterpretedFunction.run = run
            interpreter._patch_lang_tensor, autotuner.Autotuner.run = patch_lang_tensor, autotune_run

    return patched()


def _count(event: Any, layer: str, out: Counter) -> None:
    name = event.name
    if name.startswith("layer:"):
        layer = name[len("layer:"):]
    elif name.startswith(("triton::", "stub::")):
        out[(layer, name)] += 1  # a stand-in's own ops are its reference's: only nested stand-ins count
        for child in event.cpu_children:
            if child.name.startswith("stub::"):
                _count(child, layer, out)
        return
    elif name.startswith("aten::"):
        op = name[len("aten::"):]
        if op in HOST_READS:
            out[(layer, "host read")] += 1
            return
        if op not in METADATA:
            out[(layer, op)] += 1
            return
    for child in event.cpu_children:
        _count(child, layer, out)


def count_decode_step(preset: str, seed: int = 0) -> Counter:
    """``(layer kind, op) -> launches`` of one batch-1 decode step of ``preset``'s tiny twin."""
    from helixserve.models import kimi
    from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
    from helixserve.models.presets import init_random_weights

    torch.manual_seed(seed)
    cfg = tiny_config(preset)
    model = kimi.KimiForCausalLM(cfg, dtype=torch.float32)
    init_random_weights(model, seed)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    from helixserve.models import packing

    try:  # the device's packing (fused input projections, no CPU GEMM forms), where the package has it
        packing._pack_tree(model, is_root=True, host_forms=False)
    except TypeError:
        pass
    tpb = 16
    caches = allocate_caches(cfg, num_blocks=8, tokens_per_block=tpb, num_slots=2, dtype=torch.bfloat16)
    prompt = [5, 17, 42, 7, 99, 3]
    forward = kimi.KimiDecoderLayer.forward

    def labelled(self: Any, *args: Any, **kwargs: Any) -> Any:
        kind = f"{'kda' if self.is_kda else 'mla'}+{'moe' if self.is_moe else 'mlp'}"
        with record_function(f"layer:{kind}"):
            return forward(self, *args, **kwargs)

    with torch.inference_mode():
        model(build_batch([SeqChunk(prompt, 0, 1)], tpb, 4, last_token_logits_only=True), caches)
        batch = build_batch([SeqChunk([11], len(prompt), 1)], tpb, 4)
        batch.is_decode, batch.logits_indices = True, batch.cu_seqlens[:1]  # as the CUDA graph's batch
        kimi.KimiDecoderLayer.forward = labelled
        try:
            with cuda_code_path(), _interpreted_launches():
                model(batch, caches)  # Triton compiles nothing in the interpreter; one warm call all the same
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    with record_function("layer:head"):
                        model(batch, caches)
        finally:
            kimi.KimiDecoderLayer.forward = forward
    counts: Counter = Counter()
    for event in prof.events():
        if event.cpu_parent is None:
            _count(event, "head", counts)
    layers = Counter(f"{'kda' if layer.is_kda else 'mla'}+{'moe' if layer.is_moe else 'mlp'}"
                     for layer in model.model.layers)
    counts[("_layers", "count")] = 0
    return counts, layers


def summarize(counts: Counter, layers: Counter) -> dict[str, Any]:
    total = sum(n for (layer, _), n in counts.items() if layer != "_layers")
    by_kind: dict[str, dict[str, Any]] = {}
    by_phase: Counter = Counter()
    by_op: Counter = Counter()
    for (layer, op), n in counts.items():
        if layer == "_layers":
            continue
        entry = by_kind.setdefault(layer, {"layers": layers.get(layer, 1), "launches": 0, "phases": Counter()})
        entry["launches"] += n
        entry["phases"][phase_of(op)] += n
        by_phase[phase_of(op)] += n
        by_op[op] += n
    for entry in by_kind.values():
        entry["per_layer"] = entry["launches"] / entry["layers"]
        entry["phases"] = dict(entry["phases"])
    return {"total": total, "by_layer_kind": by_kind, "by_phase": dict(by_phase),
            "by_op": dict(by_op.most_common())}


def measure(models: list[str]) -> dict[str, Any]:
    return {name: summarize(*count_decode_step(name)) for name in models}


def baseline_counts(ref: str, models: list[str]) -> dict[str, Any]:
    """The same counts on the package at git ``ref`` (a child process over an extracted copy)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", ref, "helixserve"], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": tmp}
        proc = subprocess.run([sys.executable, __file__, "--child", ",".join(models)], env=env, check=True,
                              capture_output=True, text=True, cwd=tmp)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="kimi-k3-mid,kimi-linear-48b")
    parser.add_argument("--baseline", default=None, help="a git ref: count the package as it was there too")
    parser.add_argument("--child", default=None, help=argparse_suppress())
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child.split(","))))
        return
    models = args.models.split(",")
    ours = measure(models)
    base = baseline_counts(args.baseline, models) if args.baseline else {}
    rows = []
    for name in models:
        now, before = ours[name], base.get(name)
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
        rows.append([name, "total", before["total"] if before else "-", now["total"],
                     ratio(now["total"], before["total"] if before else 0)])
        for kind, entry in sorted(now["by_layer_kind"].items()):
            old = before["by_layer_kind"].get(kind) if before else None
            rows.append([name, f"{kind} per layer (x{entry['layers']})", f"{old['per_layer']:.0f}" if old else "-",
                         f"{entry['per_layer']:.0f}", ratio(entry["per_layer"], old["per_layer"] if old else 0)])
        for phase in sorted(set(now["by_phase"]) | set(before["by_phase"] if before else ())):
            old_n = before["by_phase"].get(phase, 0) if before else None
            rows.append([name, f"phase {phase}", "-" if old_n is None else old_n, now["by_phase"].get(phase, 0),
                         ratio(now["by_phase"].get(phase, 0), old_n or 0)])
    print(markdown_table(["model", "launches per bs-1 decode step", f"at {args.baseline}", "now", "ratio"], rows))
    for name in models:
        print(f"\n{name}: top operators now: " + ", ".join(f"{op} {n}" for op, n in list(ours[name]["by_op"].items())[:20]))
    write_json(args.out, {"bench": "op_count_cpu", "baseline_ref": args.baseline, "models": models,
                          "now": ours, "baseline": base})


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
