"""A CP group's other ranks: no scheduler, no request state; they run what the leader sends.

:func:`serve_follower` loops over the leader's messages (:mod:`.channel`) until ``Shutdown``:
a ``Launch`` runs this rank's ``ModelRunner`` on the step (its own block tables; input ids from
the previous step's tokens when overlapped) and then receives the leader's sampled tokens (a
verify step receives none; its KDA record is kept until the leader's ``rollback`` of it); a
``Draft`` runs a heads-TP drafter's forwards (a draft model's KDA record kept likewise; a hidden
drafter keeps each launched step's hidden states, as the leader's does); an ``Idle`` runs
the model's empty step; a ``Holds`` (a ctx world's) holds, cancels and agrees on this rank's KV
sender's holds; a ``Transfers`` starts and cancels this rank's KV
receptions and, when asked, agrees on their outcomes with the group. It raises on any failure
(a collective timed out, the model raised): the process should then end, so that the other
ranks' collectives fail fast and the world is restarted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from helixserve.engine.draft_runner import DraftRunner
from helixserve.engine.kv_holds import RankHolds
from helixserve.engine.kv_intake import RankTransfers
from helixserve.engine.model_drafters import ModelDrafter
from helixserve.engine.runner import ModelRunner
from helixserve.engine.spmd.channel import (Draft, GroupChannel, Heartbeat, Holds, Idle, Launch, Rollback, Shutdown,
                                            Transfers)
from helixserve.models.kda_spec import KdaRecord

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Follower:
    """One follower rank's parts."""

    runner: ModelRunner
    channel: GroupChannel
    transfers: RankTransfers
    num_steps: int = 0
    kda_record: KdaRecord | None = None  # the last verify step's, until the leader's rollback of it
    holds: RankHolds | None = None  # a ctx world's rank: its KV sender's holds
    draft: ModelDrafter | None = None  # a heads-TP drafter's rank
    draft_record: KdaRecord | None = None  # the last draft plan's, until the leader's rollback of it

    def roll_back(self, keep: dict[int, int] | None) -> None:
        """Roll the last verify step's speculating sequences back to ``keep`` (the leader's
        decision), the draft model's too (its record has the verify record's sequences and
        rows); a later step's record replaces the one rolled back."""
        if keep:
            assert self.kda_record is not None, "a rollback without a verify step"
            self.runner.rollback(self.kda_record, keep)
            if self.draft_record is not None:
                assert isinstance(self.draft, DraftRunner)
                self.draft.runner.rollback(self.draft_record, keep)
            self.draft_record = None
        self.kda_record = None

    def run_draft(self, message: Draft) -> None:
        """A heads-TP drafter's forwards, with the leader's (a draft model's step: its KDA record kept)."""
        if self.draft is None:
            raise RuntimeError("a Draft message to a rank without a drafter")
        # the leader's drafter is of this one's kind: it sends its own kind of work
        self.draft_record = self.draft.run_work(message.work)  # type: ignore[arg-type]

    def apply_holds(self, message: Holds) -> None:
        """A ctx world's holds on this rank's KV sender (a rank without one: a wiring bug)."""
        if self.holds is None:
            raise RuntimeError("a Holds message to a rank without a KV sender")
        for start in message.starts:
            self.holds.hold(start)
        for request_id, reason in message.cancels:
            self.holds.cancel(request_id, reason)
        if message.agree:
            self.holds.agree()

    def launch(self, message: Launch, previous: torch.Tensor | None) -> torch.Tensor | None:
        """Run a launched step; the group's sampled tokens after it (``None`` for a verify step)."""
        self.roll_back(message.rollback)
        out, runner = message.out, self.runner
        self.num_steps += 1
        if out.num_draft_tokens:  # a verify step: the leader verifies; keep the record for its rollback
            prepared = runner.prepare(out)
            runner.run(prepared)
            self.kda_record = prepared.batch.kda_record
            if self.draft is not None:
                self.draft.record(out, prepared.batch)
            return None
        input_tokens = previous if message.use_previous_tokens else None
        if runner.graphs_for(out, input_tokens) is None:
            prepared = runner.prepare(out, input_tokens)
            runner.run(prepared)
            if self.draft is not None:  # a hidden drafter keeps the step's hidden states, as the leader's
                self.draft.record(out, prepared.batch)
        else:
            runner.run_step(out, None, input_tokens)
        num_sampled = sum(1 for s in out.seqs if s.sample)
        if not num_sampled:
            return previous
        return self.channel.broadcast_tokens(torch.empty(num_sampled, dtype=torch.int64, device=runner.device))


@torch.inference_mode()
def serve_follower(follower: Follower) -> int:
    """Run the leader's messages until it shuts the group down; returns the model steps run."""
    runner, channel = follower.runner, follower.channel
    previous: torch.Tensor | None = None  # the last step's sampled tokens (this device)
    while True:
        message = channel.receive()
        if isinstance(message, Launch):
            previous = follower.launch(message, previous)
        elif isinstance(message, Rollback):
            follower.roll_back(message.keep)
        elif isinstance(message, Draft):
            follower.run_draft(message)
        elif isinstance(message, Transfers):
            for request_id in message.cancels:
                follower.transfers.cancel(request_id)
            for request_id, handle, ticket in message.starts:
                follower.transfers.start(request_id, handle, ticket)
            if message.agree:
                follower.transfers.agree(wait=message.wait)
        elif isinstance(message, Holds):
            follower.apply_holds(message)
        elif isinstance(message, Idle):
            runner.model.empty_step()
            follower.num_steps += 1
        elif isinstance(message, Shutdown):
            return follower.num_steps
        elif not isinstance(message, Heartbeat):
            raise TypeError(f"unknown CP group message {message!r}")
