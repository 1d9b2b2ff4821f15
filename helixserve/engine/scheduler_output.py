"""What the scheduler hands out each step (torch-free): :class:`SchedulerOutput`, the ids,
tokens, positions and block tables the runner needs, and :class:`RequestUpdate`, one sampled token
of a request after ``update_from_output``."""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.engine.request import RequestStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        token_ids: the new tokens to run, at positions ``context_len ..``.
        context_len: tokens already in the cache for this request.
        block_table: global logical block -> physical block on this rank (``-1`` if not held
            here); covers at least ``context_len + len(token_ids)`` tokens; pad to the batch max.
        slot: KDA state slot (``None`` without KDA layers). ``context_len == 0`` means a fresh
            slot whose state must start at zero (see ``SchedulerOutput.reset_slot_ids``).
        is_prefill: False for a decode step (the one token sampled last step), True for a
            prompt chunk (or a recompute chunk after preemption).
        sample: sample from this chunk's last row.
        num_draft_tokens: a speculating decode: ``token_ids`` is the last sampled token followed
            by this many draft tokens, every row is scored and the drafts verified (0: none).
        restore_checkpoint: a prefill starting from a cached prefix: copy this KDA state
            checkpoint into ``slot`` before the step (``None``: none).
        save_checkpoint: copy ``slot``'s KDA state into this checkpoint after the step.
        inner_saves: ``(rows, checkpoint)``: the KDA state after this chunk's first ``rows``
            rows goes into ``checkpoint``, taken during the forward (a prefill chunk's
            checkpoint positions inside it).
    """

    request_id: str
    token_ids: list[int]
    context_len: int
    block_table: list[int]
    slot: int | None
    is_prefill: bool
    sample: bool
    num_draft_tokens: int = 0
    restore_checkpoint: int | None = None
    save_checkpoint: int | None = None
    inner_saves: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def reset_slot_ids(self) -> list[int]:
        """Slots starting a sequence from scratch this step: zero their KDA state first."""
        return [s.slot for s in self.seqs if s.context_len == 0 and s.slot is not None]

    @property
    def state_restores(self) -> list[tuple[int, int]]:
        """``(checkpoint, slot)`` pairs to copy before the step (prefixes from the cache)."""
        return [(s.restore_checkpoint, s.slot) for s in self.seqs
                if s.restore_checkpoint is not None and s.slot is not None]

    @property
    def state_saves(self) -> list[tuple[int, int]]:
        """``(slot, checkpoint)`` pairs to copy after the step."""
        return [(s.slot, s.save_checkpoint) for s in self.seqs if s.save_checkpoint is not None and s.slot is not None]


@dataclass(slots=True, frozen=True)
class RequestUpdate:
    """A sampled token of one request, and whether the request finished with it; a request that
    failed carries no token (``-1``) and, when its engine step failed, ``error`` says why."""

    request_id: str
    token_id: int
    status: RequestStatus
    error: str | None = None
    num_cached_tokens: int | None = None  # on a request's last update: its prefix-cache hit

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
