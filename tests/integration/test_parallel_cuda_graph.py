"""One GPU, a world of one (NCCL): the padded MoE all-to-all and the buffered collectives run with
no host sync (CUDA sync debug mode "error") and a CUDA graph holds them; replays with new inputs
equal the eager host-split path. The multi-GPU capture is checked in the two-GPU issue.
"""

from __future__ import annotations

import pytest
import torch

from helixserve.launch.processes import run_local_world
from helixserve.parallel import (Mapping, all_gather_rows, init_parallel, lse_all_to_all, lse_buffers, moe_a2a,
                                 reduce_scatter_rows)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, HIDDEN, OUT, EXPERTS, TOP_K, HEADS, LATENT = 16, 32, 24, 8, 3, 4, 16


def _inputs(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(ROWS, EXPERTS, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    if seed % 2:
        ids[: ROWS // 2] = ids[: ROWS // 2] % 2  # skewed routing
    ids[0, 1] = -1
    tensors = {"x": torch.randn(ROWS, HIDDEN, generator=gen), "ids": ids, "weights": weights,
               "o": torch.randn(ROWS, HEADS, LATENT, generator=gen), "lse": torch.randn(ROWS, HEADS, generator=gen)}
    return {k: v.to(device) for k, v in tensors.items()}


def _graph_worker(rank: int, world_size: int, init_method: str) -> dict[str, object]:
    groups = init_parallel(Mapping(1, 0, cp=1), init_method, backend="nccl", local_rank=0, timeout_s=60)
    dev = groups.device
    w = torch.randn(EXPERTS, HIDDEN, OUT, generator=torch.Generator().manual_seed(7)).to(dev)
    def fn(x: torch.Tensor, ids: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        # padded path: masked slots carry the out-of-range id EXPERTS (ep = 1)
        y = torch.einsum("rd,rdo->ro", x, w[ids.clamp(max=EXPERTS - 1)]) * wt[:, None]
        return torch.where((ids < EXPERTS)[:, None], y, 0.0)

    static = _inputs(0, dev)
    flag = torch.zeros((), dtype=torch.bool, device=dev)
    gathered = torch.empty(ROWS, OUT, device=dev)
    scattered = torch.empty(ROWS, OUT, device=dev)
    lse_buf = lse_buffers(ROWS, HEADS, LATENT, 1, torch.float32, torch.float32, dev)

    def step() -> tuple[torch.Tensor, ...]:
        y = moe_a2a(static["x"], static["ids"], static["weights"], fn, num_experts=EXPERTS, group=groups.ep,
                    capacity=ROWS, overflow=flag)
        full = all_gather_rows(y, ROWS, groups.cp, out=gathered)
        part = reduce_scatter_rows(full, groups.cp, out=scattered)
        o_parts, lse_parts = lse_all_to_all(static["o"], static["lse"], groups.cp, buffers=lse_buf)
        return y, part, o_parts, lse_parts

    result: dict[str, object] = {}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up (NCCL communicator, allocator) off the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()  # eager, no host sync
            try:
                moe_a2a(static["x"], static["ids"], static["weights"], fn, num_experts=EXPERTS, group=groups.ep)
                result["host_split_synced"] = False
            except RuntimeError as exc:
                result["host_split_synced"] = "synchronizing" in str(exc)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        replays = 0
        for seed in (1, 2, 3):
            for name, value in _inputs(seed, dev).items():
                static[name].copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            ref = moe_a2a(static["x"], static["ids"], static["weights"], fn, num_experts=EXPERTS, group=groups.ep)
            torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(outs[1], ref, rtol=1e-5, atol=1e-6)
            assert torch.equal(outs[2][0], static["o"]) and torch.equal(outs[3][0], static["lse"])
            replays += 1
        result["replays"] = replays
        result["overflow"] = bool(flag)
        return result
    finally:
        groups.destroy()


def test_cuda_graph_holds_the_padded_helix_collectives() -> None:
    assert run_local_world(_graph_worker, 1, timeout_s=300) == [{"host_split_synced": True, "replays": 3,
                                                                 "overflow": False}]


def _kernel_graph_worker(rank: int, world_size: int, init_method: str) -> int:
    """The model's expert callback (the kernels' bf16 grouped GEMM) inside the captured padded layer."""
    from helixserve.kernels.moe.experts import moe_experts

    groups = init_parallel(Mapping(1, 0, cp=1), init_method, backend="nccl", local_rank=0, timeout_s=60)
    dev = groups.device
    gen = torch.Generator().manual_seed(11)
    w13 = (torch.randn(EXPERTS, 64, HIDDEN, generator=gen) / HIDDEN**0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, 32, generator=gen) / 6).to(dev, torch.bfloat16)
    fn = lambda x, ids, wt: moe_experts(x, ids[:, None], wt[:, None], w13, w2)  # noqa: E731
    static = {k: v.to(torch.bfloat16) if k == "x" else v for k, v in _inputs(0, dev).items()}
    try:
        layer = lambda: moe_a2a(static["x"], static["ids"], static["weights"], fn, num_experts=EXPERTS,  # noqa: E731
                                group=groups.ep, capacity=ROWS)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        replays = 0
        for seed in (4, 5):
            for name, value in _inputs(seed, dev).items():
                static[name].copy_(value)
            graph.replay()
            ref = moe_a2a(static["x"], static["ids"], static["weights"], fn, num_experts=EXPERTS, group=groups.ep)
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            replays += 1
        return replays
    finally:
        groups.destroy()


def test_cuda_graph_holds_the_padded_layer_with_the_grouped_expert_kernel() -> None:
    assert run_local_world(_kernel_graph_worker, 1, timeout_s=300) == [2]
