"""The step metadata's int64 views start on 16-byte boundaries whatever the row and sequence
counts: Triton specializes pointer arguments on 16-byte alignment, so a count-dependent alignment
compiled a new kernel variant on the first request of some prompt lengths (seen on the H200: a
512-token prompt after a warm-up of odd lengths compiled the paged attention kernel for 0.9 s)."""

from __future__ import annotations

import pytest

from helixserve.engine.runner import build_forward_batch
from helixserve.engine.scheduler import ScheduledSeq, SchedulerOutput


def _seq(rid: str, n: int, context: int, sample: bool) -> ScheduledSeq:
    return ScheduledSeq(request_id=rid, token_ids=list(range(1, n + 1)), context_len=context,
                        block_table=[0, 1, 2], slot=int(rid), is_prefill=context == 0, sample=sample)


@pytest.mark.parametrize("lengths", [[1], [512], [513], [3, 4], [7, 1, 1], [2, 2, 2, 2], [5, 8, 1, 1, 1]])
def test_every_metadata_view_is_16_byte_aligned_and_holds_its_values(lengths: list[int]) -> None:
    seqs = [_seq(str(i), n, 0 if n > 1 else 4, sample=i % 2 == 0) for i, n in enumerate(lengths)]
    batch = build_forward_batch(SchedulerOutput(seqs=seqs))
    views = {"input_ids": batch.input_ids, "positions": batch.positions, "cu_seqlens": batch.cu_seqlens,
             "context_lens": batch.context_lens, "state_slots": batch.state_slots}
    if batch.logits_indices is not None:
        views["logits_indices"] = batch.logits_indices
    for name, view in views.items():
        assert view.data_ptr() % 16 == 0, f"{name} starts at {view.data_ptr() % 16} mod 16 for {lengths}"
    assert batch.input_ids.tolist() == [t for s in seqs for t in s.token_ids]
    assert batch.positions.tolist() == [p for s in seqs for p in range(s.context_len, s.context_len + len(s.token_ids))]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    assert batch.cu_seqlens.tolist() == cu
    assert batch.context_lens.tolist() == [s.context_len for s in seqs]
    assert batch.state_slots.tolist() == [s.slot for s in seqs]
    want_logits = [cu[i + 1] - 1 for i, s in enumerate(seqs) if s.sample]
    if batch.logits_indices is not None:
        assert batch.logits_indices.tolist() == want_logits
    else:
        assert len(want_logits) == sum(lengths)
