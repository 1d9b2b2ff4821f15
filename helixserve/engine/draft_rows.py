"""A draft step's rows and KDA records (:mod:`.draft_runner`): forward 0's rows of a scheduled step,
forward ``j``'s draft rows, each forward's record of its speculating rows, and the forwards'
records combined into one shaped as the target's verify record."""

from __future__ import annotations

import torch

from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.host_copy import to_device
from helixserve.models.kda_spec import KdaRecord, KdaSaved


def first_rows(seq: ScheduledSeq, table: list[int]) -> ScheduledSeq:
    """``seq`` as forward 0 runs it (on the draft's block ``table``): a speculating sequence's
    last sampled token only, sampled; anything else as scheduled, unsampled."""
    if not seq.num_draft_tokens:
        return ScheduledSeq(seq.request_id, seq.token_ids, seq.context_len, table, seq.slot,
                            seq.is_prefill, sample=False)
    return ScheduledSeq(seq.request_id, seq.token_ids[:1], seq.context_len, table, seq.slot,
                        is_prefill=False, sample=True)


def draft_row(seq: ScheduledSeq, j: int, table: list[int]) -> ScheduledSeq:
    """Forward ``j``'s row of a speculating sequence: draft ``j`` (its token comes from the
    previous forward), sampled while drafts are left to draw."""
    return ScheduledSeq(seq.request_id, [0], seq.context_len + j, table, seq.slot, is_prefill=False,
                        sample=seq.num_draft_tokens > j)


def draft_record(step: SchedulerOutput, recorded: list[int], device: torch.device) -> KdaRecord:
    """A KDA record of one row (each sequence's last) of the sequences ``recorded``; row by row
    when every sequence of ``step`` is one row after a cached context."""
    ends, end = [], 0
    for s in step.seqs:
        end += s.num_tokens
        ends.append(end - 1)
    as_tensor = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), device)  # noqa: E731
    slots = [step.seqs[i].slot for i in recorded]
    record = KdaRecord(as_tensor(recorded), as_tensor([ends[i] for i in recorded]), list(range(len(recorded))),
                       [1] * len(recorded), as_tensor(slots), list(recorded))
    if all(s.num_tokens == 1 and s.context_len > 0 for s in step.seqs):
        record.steps = [(as_tensor(list(range(len(step.seqs)))), as_tensor([s.slot for s in step.seqs]))]
    return record


def combined_record(records: list[KdaRecord], spec: list[int], num_drafts: list[int]) -> KdaRecord:
    """The draft forwards' records as one verify record: speculating sequence ``p``'s rows
    ``0 .. n_p`` (forward ``j``'s row for ``j``), sequence after sequence; the pre-step states
    are forward 0's."""
    order: list[int] = []
    offsets = [0]
    for j in range(len(records)):
        offsets.append(offsets[-1] + sum(n >= j for n in num_drafts))
    for p, n in enumerate(num_drafts):
        order += [offsets[j] + sum(m >= j for m in num_drafts[:p]) for j in range(n + 1)]
    device = records[0].slots.device
    index = to_device(torch.tensor(order, dtype=torch.int64), device)
    starts = [0]
    for n in num_drafts[:-1]:
        starts.append(starts[-1] + n + 1)
    combined = KdaRecord(to_device(torch.tensor(spec, dtype=torch.int64), device), index, starts,
                         [n + 1 for n in num_drafts], records[0].slots, list(spec))
    for layer, first in records[0].layers.items():
        parts = [r.layers[layer] for r in records]
        combined.layers[layer] = KdaSaved(
            *(torch.cat([getattr(s, name) for s in parts]).index_select(0, index) for name in ("qkv", "g", "beta")),
            first.conv_state, first.kda_state)
    return combined
