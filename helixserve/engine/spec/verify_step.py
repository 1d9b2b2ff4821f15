"""A verify step's engine side (torch): the rows it scores, its verified runs, its KDA record.

A speculating sequence's row of a step is its last sampled token followed by its ``n`` drafts,
``n + 1`` rows together in the flat varlen batch like a prefill chunk with context (MLA needs no
other kernel); every one of its rows is scored. Its logits, ``[n + 1, V]``, are padded into
``[B, K + 1, V]`` with the step's other speculating sequences for
:func:`~helixserve.engine.spec.verify.verify_drafts`; the step's sequences without drafts
sample their last row through the sampler as in plain decoding. Seeded requests draw from their
own generators (batch-independent tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.engine.sampler import Sampler
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.engine.spec.verify import verify_drafts
from helixserve.host_copy import to_device
from helixserve.models.kda_spec import KdaRecord


@dataclass(slots=True)
class VerifiedStep:
    """Each sampled request's run (a sampled token, or its accepted drafts then the correction or
    bonus token) and, per speculating sequence, ``(drafts, accepted)``."""

    runs: dict[str, list[int]]
    accepted: list[tuple[int, int]] = field(default_factory=list)


def logits_rows(out: SchedulerOutput) -> list[int]:
    """The flat rows whose logits a step wants: a sampled sequence's last row, every row of a
    speculating one."""
    rows: list[int] = []
    end = 0
    for s in out.seqs:
        end += s.num_tokens
        if s.sample:
            rows.extend(range(end - 1 - s.num_draft_tokens, end))
    return rows


def kda_record(out: SchedulerOutput, device: torch.device) -> KdaRecord | None:
    """The record a verify step's KDA layers fill (``None``: no speculating sequence). When every
    sequence continues a cached context (no prompt chunk beside the verify rows) the step runs
    row by row (``KdaRecord.steps``, :mod:`helixserve.models.kda_spec`)."""
    seq_index: list[int] = []
    rows: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    slots: list[int] = []
    begin = 0
    for i, s in enumerate(out.seqs):
        if s.num_draft_tokens and s.slot is not None:
            seq_index.append(i)
            starts.append(len(rows))
            counts.append(s.num_tokens)
            rows.extend(range(begin, begin + s.num_tokens))
            slots.append(s.slot)
        begin += s.num_tokens
    if not seq_index:
        return None
    as_tensor = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), device)  # noqa: E731
    record = KdaRecord(as_tensor(seq_index), as_tensor(rows), starts, counts, as_tensor(slots), seq_index)
    if all(s.context_len > 0 and s.slot is not None and s.num_tokens == 1 + s.num_draft_tokens for s in out.seqs):
        record.steps = _row_steps(out, device)
    return record


def _row_steps(out: SchedulerOutput, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row offset ``j``: the flat rows of the sequences with more than ``j`` rows and their
    slots (views of one tensor: one copy to the device)."""
    begins, begin = [], 0
    for s in out.seqs:
        begins.append(begin)
        begin += s.num_tokens
    parts: list[list[int]] = []
    for j in range(max(s.num_tokens for s in out.seqs)):
        live = [i for i, s in enumerate(out.seqs) if s.num_tokens > j]
        parts += [[begins[i] + j for i in live], [out.seqs[i].slot for i in live]]  # type: ignore[misc]
    flat = to_device(torch.tensor([x for part in parts for x in part], dtype=torch.int64), device)
    views = flat.split_with_sizes([len(part) for part in parts])
    return [(views[2 * j], views[2 * j + 1]) for j in range(len(parts) // 2)]


def verify_step(sampler: Sampler, out: SchedulerOutput, logits: torch.Tensor,
                params: Mapping[str, SamplingParams]) -> VerifiedStep:
    """The runs of a step with drafts from its wanted rows' ``logits`` (:func:`logits_rows` order)."""
    sampled = [s for s in out.seqs if s.sample]
    starts, row = [], 0
    for s in sampled:
        starts.append(row)
        row += 1 + s.num_draft_tokens
    runs: dict[str, list[int]] = {}
    plain = [j for j, s in enumerate(sampled) if not s.num_draft_tokens]
    if plain:
        ids = [sampled[j].request_id for j in plain]
        where = to_device(torch.tensor([starts[j] for j in plain]), logits.device)
        tokens = sampler.launch(logits.index_select(0, where), ids, [params[r] for r in ids]).tolist()
        runs.update((rid, [t]) for rid, t in zip(ids, tokens, strict=True))
    spec = [j for j, s in enumerate(sampled) if s.num_draft_tokens]
    if not spec:
        return VerifiedStep(runs)
    K = max(sampled[j].num_draft_tokens for j in spec)
    target = logits.new_zeros(len(spec), K + 1, logits.shape[1])
    drafts = torch.full((len(spec), K), -1, dtype=torch.int64)
    for b, j in enumerate(spec):
        n = sampled[j].num_draft_tokens
        target[b, : n + 1] = logits[starts[j]: starts[j] + n + 1]
        drafts[b, :n] = torch.tensor(sampled[j].token_ids[1:])
    ids = [sampled[j].request_id for j in spec]
    p = [params[r] for r in ids]
    generators = [None if q.is_greedy else sampler.generator(r, q) for r, q in zip(ids, p, strict=True)]
    result = verify_drafts(target, to_device(drafts, logits.device), [sampled[j].num_draft_tokens for j in spec],
                           p, generators)
    tokens, accepted = result.token_ids.tolist(), result.num_accepted.tolist()
    step = VerifiedStep(runs)
    for b, j in enumerate(spec):
        runs[ids[b]] = tokens[b][: accepted[b] + 1]
        step.accepted.append((sampled[j].num_draft_tokens, accepted[b]))
    return step


def kept_rows(out: SchedulerOutput, record: KdaRecord,
              get_request: Callable[[str], Request | None]) -> dict[int, int]:
    """After ``update_from_output``: each of ``record``'s sequences still running whose cache kept
    fewer rows than the step ran for it (``record.num_rows``: a graphed step pads every sequence to
    the same rows) (index into the record -> rows kept: its computed count's advance)."""
    keep: dict[int, int] = {}
    for i, b in enumerate(record.batch_seqs):
        seq = out.seqs[b]
        request = get_request(seq.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue  # finished: its slot is freed, a new owner starts it from zero
        kept = request.num_computed_tokens - seq.context_len
        if kept < record.num_rows[i]:
            keep[i] = kept
    return keep
