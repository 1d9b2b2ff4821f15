"""How one shard's bytes reach a gen rank: three transports behind one interface.

An `inbound.Inbound` owns a request's life on this rank (its deadline, the conversation with the
ctx worker: RequestShard, Cancel, Acknowledge; its outcome, which the CP group agrees on) and
hands the bytes to one :class:`ShardTransport` at a time:

- `granted_pull.GrantedPull`: the ticket carries the ctx's `PullGrant` for pools this rank has
  open (see `grant`, `lease`): the copy out of them is launched at once, with no RequestShard;
  once it ended, the lease word is read again.
- `asked_pull.AskedPull`: this rank has the ctx's pools open (see `cuda_ipc`): RequestShard names
  their epoch, and the ctx answers with the block table to copy out of (`PullShard`).
- `tagged_stream.TaggedStream`: the ctx sends the shard as UCX tagged messages; every receive is
  posted right after RequestShard went out (see `layout`, `retract`).

Hand-offs, each made by `Inbound.switch_to` and logged naming both transports:

1. granted pull -> asked pull: after the copy the lease word no longer holds the grant's serial
   (the ctx began freeing the blocks): the copy is thrown away and the rank asks with
   RequestShard, which rewrites every byte or is refused.
2. asked pull -> tagged stream: the ctx answered RequestShard with the tagged stream (the pools'
   epoch is not its own: it restarted); its pools are described again on the next request.
3. granted or asked pull -> tagged stream, while giving up: the Cancel reply says the ctx posted
   messages after all; they are received (drained) before anything is retracted.

Nothing hands off from the tagged stream. A transport handed off from stays with its inbound,
which is quiesced only once every transport it used is (a copy may still be running).

Both pulls share :class:`PullTransport`: the copy out of the ctx's opened pools (`pull`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.kvcache.manager import CacheHandle
from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.cuda_ipc import RemotePools
from helixserve.transceiver.gen.pull import Pull, pull_pair
from helixserve.transceiver.layout import ShardPlan
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class Progress(enum.Enum):
    """What one `ShardTransport.advance` brought about (``None``: nothing to act on yet)."""

    LANDED = "landed"  # every byte of the shard is in place: the inbound acknowledges it
    REVOKED = "revoked"  # granted pull: the ctx freed the blocks during the copy: ask instead
    STREAMED = "streamed"  # asked pull: the ctx answered with the tagged stream: receive it


class ShardOwner(Protocol):
    """What a transport sees of its `inbound.Inbound`: the request, its handle, and the ctx
    conversation and outcome, which stay with the inbound."""

    r: Any  # the rank's `receiver.KVReceiver`: plane, staging, retractor, pool directory, counters
    request_id: str
    ctx: str  # "ctx worker host:port", as errors name it
    ticket: KVTicket
    plan: ShardPlan  # this rank's shard, cut with the rank's own message size
    handle: CacheHandle
    caches: ModelCaches
    draft_blocks: list[int]  # the drafter's pages of the request (its full-row table) when the shard takes them
    device: torch.device | None
    tag_base: int
    error: str | None  # the request's first error

    def ask(self, deadline_s: float, pull_epoch: int | None = None) -> Future:
        """Send RequestShard; its future."""
        ...

    def answer(self, future: Future) -> pb.ShardReply | None:
        """The ctx's accepted reply; None once the request failed or closed."""
        ...

    def check_aux(self, aux: torch.Tensor) -> None:
        """Fail the request unless the ctx's AUX names the ticket's prefill."""
        ...

    def fail(self, error: str) -> None: ...

    def stop(self, reason: str) -> None:
        """Give up: Cancel, drain, close."""
        ...


class ShardTransport(Protocol):
    """One way of moving a shard into this rank's handle (engine thread only).

    Problems are reported through the inbound (`Inbound.fail`, or it gives up with
    `Inbound.stop` / `Inbound.fail_unsent`), never raised."""

    name: ClassVar[str]  # as the log lines name it: "granted pull", "asked pull", "tagged stream"
    pulls: ClassVar[bool]  # its bytes come by a device copy, whose end sets no wakeup
    has_asked: ClassVar[bool]  # it asks with RequestShard: a ctx stream cuts messages as this rank asked
    copy: Pull | None  # the copy launched out of the ctx's pools, if any
    moves_draft: bool  # it moves the drafter's prompt cache the shard names (a pull: when the ctx exports it)

    def start(self, deadline_s: float) -> bool:
        """Begin within `deadline_s`; False: nothing was started (the inbound asks instead)."""
        ...

    def advance(self) -> Progress | None:
        """Non-blocking progress."""
        ...

    def awaits_ctx(self) -> bool:
        """It waits on the ctx worker (an answer, or its messages): the ctx's death fails it."""
        ...

    def stop(self) -> None:
        """The inbound gave up (its Cancel, with the reason, follows): end what this side has in
        flight, within ``drain_timeout_ms`` (a launched copy waited for, RequestShard cancelled)."""
        ...

    def drain(self, limit: int) -> bool:
        """Land the first `limit` messages the ctx posted (-1: not known yet); True once each ended."""
        ...

    def close(self, may_still_send: int | None) -> None:
        """Retract whatever is still posted (messages below `may_still_send` may still come;
        None: any)."""
        ...

    def kind_state(self, kind: PayloadKind) -> TransferState:
        """COMPLETED once `kind`'s bytes landed, else TRANSFERRING."""
        ...

    def is_quiesced(self) -> bool:
        """Nothing of this transport can write into the handle any more."""
        ...


class PullTransport:
    """What both pulls share: one copy of the shard out of the ctx's opened `pools` into the
    inbound's handle, which ends in the engine's stream order (see `pull`)."""

    pulls: ClassVar[bool] = True

    def __init__(self, inbound: ShardOwner, pools: RemotePools) -> None:
        self.inbound = inbound
        self.pools = pools
        self.copy: Pull | None = None
        self.has_landed = False
        self.moves_draft = False  # the copy takes the drafter's prompt cache too (the ctx exports it)

    def launch(self, src_block_ids: Sequence[int], src_slot: int | None) -> Pull:
        """Launch the copy of this rank's shard out of the ctx rank's opened pools, whose request
        holds its k-th local block at ``src_block_ids[k]`` and its KDA state at `src_slot`."""
        inbound = self.inbound
        spec = inbound.plan.spec
        pair = pull_pair(self.pools.pairs, spec.layout, self.pools.caches, inbound.caches, spec.num_local_heads)
        groups = pair.groups(spec, src_block_ids, src_slot, inbound.handle.block_ids, inbound.handle.slot,
                             inbound.draft_blocks)
        self.moves_draft = spec.takes_draft and pair.moves_draft
        return Pull(pair, groups, inbound.device)

    def stop(self) -> None:
        """Wait (bounded) for a launched copy, so that nothing writes once the inbound closed."""
        drain_timeout_s = self.inbound.r.config.drain_timeout_s
        if self.copy is not None and not self.copy.wait(drain_timeout_s):
            logger.error("request %s: the copy out of %s's pools did not end within %.1f s",
                         self.inbound.request_id, self.inbound.ctx, drain_timeout_s)

    def drain(self, limit: int) -> bool:
        return limit >= 0  # nothing was posted: drained once the ctx's count is known

    def close(self, may_still_send: int | None) -> None:
        pass  # nothing is posted for a pull

    def kind_state(self, kind: PayloadKind) -> TransferState:
        return TransferState.COMPLETED if self.has_landed else TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        return self.copy is None or self.copy.is_done()
