"""A CP group's other ranks: no scheduler, no request state; they run what the leader sends.

:func:`serve_follower` loops over the leader's messages (:mod:`.channel`) until ``Shutdown``:
a ``Launch`` runs this rank's ``ModelRunner`` on the step (its own block tables; input ids from
the previous step's tokens when overlapped) and then receives the leader's sampled tokens; an
``Idle`` runs the model's empty step; a ``Transfers`` starts and cancels this rank's KV
receptions and, when asked, agrees on their outcomes with the group. It raises on any failure
(a collective timed out, the model raised): the process should then end, so that the other
ranks' collectives fail fast and the world is restarted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from helixserve.engine.kv_intake import RankTransfers
from helixserve.engine.runner import ModelRunner
from helixserve.engine.spmd.channel import GroupChannel, Heartbeat, Idle, Launch, Shutdown, Transfers

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Follower:
    """One follower rank's parts."""

    runner: ModelRunner
    channel: GroupChannel
    transfers: RankTransfers
    num_steps: int = 0


@torch.inference_mode()
def serve_follower(follower: Follower) -> int:
    """Run the leader's messages until it shuts the group down; returns the model steps run."""
    runner, channel = follower.runner, follower.channel
    previous: torch.Tensor | None = None  # the last step's sampled tokens (this device)
    while True:
        message = channel.receive()
        if isinstance(message, Launch):
            out = message.out
            runner.forward(out, previous if message.use_previous_tokens else None)
            num_sampled = sum(1 for s in out.seqs if s.sample)
            if num_sampled:
                previous = channel.broadcast_tokens(torch.empty(num_sampled, dtype=torch.int64, device=runner.device))
            follower.num_steps += 1
        elif isinstance(message, Transfers):
            for request_id in message.cancels:
                follower.transfers.cancel(request_id)
            for request_id, handle, ticket in message.starts:
                follower.transfers.start(request_id, handle, ticket)
            if message.agree:
                follower.transfers.agree(wait=message.wait)
        elif isinstance(message, Idle):
            runner.model.empty_step()
            follower.num_steps += 1
        elif isinstance(message, Shutdown):
            return follower.num_steps
        elif not isinstance(message, Heartbeat):
            raise TypeError(f"unknown CP group message {message!r}")
