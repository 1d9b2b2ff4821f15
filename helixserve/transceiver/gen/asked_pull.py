"""The asked pull: a shard copied out of the ctx's opened pools on the ctx's answer.

This rank has the ctx's pools open over CUDA IPC (see `cuda_ipc`), so its RequestShard names
their epoch and no receive is posted. A ctx that answers with `PullShard` sends nothing: its
AUX is checked against the ticket and the shard is copied out of its pools by one unit-copy
launch (see `pull`), then acknowledged. A ctx that answers with the tagged stream instead (the
epoch is not its own: it restarted) is described again on the next request, and the inbound
hands off to the tagged stream (`Progress.STREAMED`), whose receives are posted then.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import ClassVar

import torch

from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.control import target
from helixserve.transceiver.cuda_ipc import RemotePools
from helixserve.transceiver.gen.transport import Progress, PullTransport, ShardOwner


class AskedPull(PullTransport):
    """RequestShard naming the pools' epoch, then the copy the ctx's `PullShard` describes."""

    name: ClassVar[str] = "asked pull"
    has_asked: ClassVar[bool] = True

    def __init__(self, inbound: ShardOwner, pools: RemotePools) -> None:
        super().__init__(inbound, pools)
        self.future: Future | None = None  # RequestShard
        self.reply: pb.ShardReply | None = None  # the ctx's answer with the tagged stream (handed off)

    def start(self, deadline_s: float) -> bool:
        self.future = self.inbound.ask(deadline_s, pull_epoch=self.pools.epoch)
        return True

    def advance(self) -> Progress | None:
        if self.copy is None and self.future is not None and self.future.done():
            reply = self.inbound.answer(self.future)
            if reply is None:
                return None
            if not reply.HasField("pull"):  # it chose the tagged stream: it restarted, describe it again
                self.inbound.r.pools.forget(target(self.inbound.ticket.ctx_endpoint))
                self.reply = reply
                return Progress.STREAMED
            self._start_pull(reply.pull)
        if self.copy is not None and self.copy.is_done() and self.inbound.error is None:
            self.has_landed = True
            return Progress.LANDED
        return None

    def _start_pull(self, shard: pb.PullShard) -> None:
        inbound = self.inbound
        try:
            inbound.check_aux(torch.tensor(list(shard.aux), dtype=torch.int64))
            if inbound.error is not None:
                return inbound.stop("the ctx holds another prefill")
            self.copy = self.launch(list(shard.src_block_ids), None if shard.src_slot < 0 else int(shard.src_slot))
            inbound.r.num_pulled += 1
        except Exception as error:
            inbound.fail(f"{inbound.ctx}'s pull shard is unusable: {type(error).__name__}: {error}")
            return inbound.stop("unusable pull shard")  # it accepted: it keeps the blocks until told
        return None

    def awaits_ctx(self) -> bool:
        return self.copy is None  # its answer; a launched copy reads the ctx's pools, nothing more comes

    def stop(self) -> None:
        super().stop()  # a launched copy ends first
        if self.copy is None and self.future is not None:
            self.future.cancel()
