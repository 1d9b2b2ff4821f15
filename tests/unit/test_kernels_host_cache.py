"""The per-step host cache of metadata reads, and the runner's batch for a pure decode step."""

from __future__ import annotations

import torch

from helixserve.engine.runner import build_forward_batch
from helixserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from helixserve.kernels._host import host_list, step_host_cache


def test_host_list_is_read_once_per_step_and_object():
    a, b = torch.tensor([3, 1, 2]), torch.tensor([3, 1, 2])
    assert host_list(a) is not host_list(a)  # outside a step: a fresh read each time
    with step_host_cache():
        first = host_list(a)
        assert first == [3, 1, 2] and host_list(a) is first
        assert host_list(b) == first and host_list(b) is not first  # another tensor, its own read
        with step_host_cache():  # nested: the same cache
            assert host_list(a) is first
    with step_host_cache():
        assert host_list(a) is not first  # a new step reads again


def _seq(rid: str, tokens: list[int], context: int, sample: bool) -> ScheduledSeq:
    return ScheduledSeq(request_id=rid, token_ids=tokens, context_len=context, block_table=[0, 1],
                        slot=0, is_prefill=context == 0, sample=sample)


def test_decode_batch_wants_every_row():
    decode = build_forward_batch(SchedulerOutput(seqs=[_seq("a", [5], 7, True), _seq("b", [6], 3, True)]))
    assert decode.logits_indices is None and decode.is_decode
    mixed = build_forward_batch(SchedulerOutput(seqs=[_seq("a", [5, 6, 7], 0, True), _seq("b", [6], 3, True)]))
    assert mixed.logits_indices.tolist() == [2, 3] and not mixed.is_decode
