"""Decode memory-bandwidth utilisation (MBU) of the engine: the bytes one decode step must read,
over the step's time, as a share of the same run's device-copy bandwidth.

Bytes a step must read, from the live model and caches (:func:`step_bytes`):

- every weight (parameter) except the routed experts and the input embedding, once per step (a
  head tied to the embedding is counted whole, as the head reads it; derived copies the layers keep
  of their weights, fused or transposed, are not counted twice);
- the input embedding's rows of the step's tokens;
- the routed experts a batch of ``B`` tokens touches: ``E * (1 - (1 - k / E) ** B)`` of the ``E``
  experts of each MoE layer (routing taken as uniform; random weights route about uniformly);
- per sequence, the MLA latent KV of its context in every MLA layer, and its KDA recurrent and
  conv state in every KDA layer.

The copy bandwidth counts bytes read plus bytes written, so a step's MBU is its read bytes over
``copy bytes/s``: 100 % would read as fast as a device copy moves bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from _decode_rate import decode_rate, find_runner
from _step_profile import step_profile_rows

from helixserve.config import CacheConfig
from helixserve.engine.llm import LLM
from helixserve.models.moe import RoutedExperts


def _tensor_bytes(module: torch.nn.Module, buffers: bool = False) -> int:
    tensors = (*module.parameters(recurse=False), *(module.buffers(recurse=False) if buffers else ()))
    return sum(t.numel() * t.element_size() for t in tensors)


def step_bytes(model: torch.nn.Module, caches: Any, batch: int, context_len: int) -> dict[str, int]:
    """The bytes one decode step of ``batch`` sequences of ``context_len`` tokens must read, by
    kind (``weights``, ``experts``, ``kv``)."""
    cfg = model.cfg
    dense = experts = 0
    for module in model.modules():
        own = _tensor_bytes(module, buffers=isinstance(module, RoutedExperts))  # (packed MXFP4 buffers)
        if isinstance(module, RoutedExperts):
            E, k = cfg.num_experts, cfg.num_experts_per_token
            experts += int(own * (1 - (1 - k / E) ** batch))
        elif isinstance(module, torch.nn.Embedding):
            dense += batch * module.weight.shape[1] * module.weight.element_size()
        else:
            dense += own
    per_token_kv = sum(t[0, 0].numel() * t.element_size() for t in caches.mla_kv.values())
    per_seq_state = sum(t[0].numel() * t.element_size() for t in (*caches.kda_state.values(), *caches.conv_state.values()))
    return {"weights": dense, "experts": experts, "kv": batch * (context_len * per_token_kv + per_seq_state)}


def bench_mbu(llm: Any, model_name: str, batches: tuple[int, ...], prompt_len: int, new_tokens: int,
              copy_bw: float | None, row, baseline: dict[int, float] | None = None,  # noqa: ANN001 (kernels.row)
              ) -> dict[int, float]:
    """Decode tok/s at each batch size and its MBU against ``copy_bw`` (bytes/s); one row each.
    ``baseline``: tok/s per batch of the same model measured earlier in the run (the row's ratio).
    Returns tok/s per batch."""
    rates: dict[int, float] = {}
    engine = llm.engine
    runner = find_runner(engine)
    gen = torch.Generator().manual_seed(37)
    vocab = llm.model_config.vocab_size
    for batch in batches:
        prompts = torch.randint(0, min(vocab, 256), (batch, prompt_len), generator=gen).tolist()
        decode_rate(engine, prompts, 4, f"mbu-warm-{batch}", runner)  # graphs captured, allocator warm
        tok_s, outside = decode_rate(engine, prompts, new_tokens, f"mbu-{batch}", runner)
        step_s = batch / tok_s
        need = step_bytes(engine.runner.model, engine.runner.caches, batch, prompt_len + new_tokens // 2)
        total = sum(need.values())
        mbu = total / step_s / copy_bw if copy_bw else None
        rates[batch] = tok_s
        base = (baseline or {}).get(batch)
        row("mbu", f"{model_name} decode bs{batch}", tok_s, base, "tok/s", "plain" if base else "-",
            ", ".join(([f"{tok_s / base:.3f}x"] if base else []) + ([f"MBU {mbu:.1%}"] if mbu is not None else [])),
            f"step {step_s * 1e3:.3f} ms, reads {total / 1e9:.3f} GB (weights {need['weights'] / 1e9:.3f}, "
            f"experts {need['experts'] / 1e9:.3f}, kv {need['kv'] / 1e9:.4f}); roofline "
            + (f"{total / copy_bw * 1e3:.3f} ms" if copy_bw else "n/a"),
            model=model_name, batch=batch, tok_s=tok_s, mbu=mbu, step_ms=step_s * 1e3, bytes=need,
            host_outside=outside)
    return rates


def mbu_rows(quick: bool, on_gpu: bool, copy_bw: float | None, row) -> None:  # noqa: ANN001 (kernels.row)
    """Decode MBU rows of dummy-weight models; on the CPU a tiny preset, no MBU."""
    models = ("kimi-k3-mid", "kimi-linear-48b") if on_gpu else ("kimi-k3-tiny",)
    batches = (1, 8, 64) if on_gpu else (1, 4)
    plain: dict[int, float] = {}
    # the batch-invariant mode is process-wide from the moment it is set: its rows come last
    for name, deterministic in [(m, False) for m in models] + [(models[0], True)]:
        llm = LLM(name, load_format="dummy", device="cuda" if on_gpu else "cpu",
                  dtype="bfloat16" if on_gpu else "float32", deterministic=deterministic,
                  cache=CacheConfig(max_num_seqs=max(batches), memory_budget_mib=8192 if on_gpu else 256))
        label = f"{name} deterministic" if deterministic else name
        rates = bench_mbu(llm, label, batches, 128 if on_gpu else 32, 16 if quick else 64, copy_bw, row,
                          baseline=plain if deterministic else None)
        if name == models[0] and not deterministic:
            plain = rates
        if not deterministic:
            step_profile_rows(llm, name, 8 if quick else 32, on_gpu, row)
        del llm
        if on_gpu:
            torch.cuda.empty_cache()
