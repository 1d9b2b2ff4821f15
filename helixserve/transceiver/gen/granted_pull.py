"""The granted pull: a shard copied on the ctx's grant, with no round trip before the copy.

The ticket carries the ctx's `PullGrant` (see `grant`): the request's physical blocks and slot in
the ctx's exported pools, a lease serial and a MAC. When this rank has those pools open under
the grant's epoch, the MAC matches this request and the lease word holds the serial (see
`lease`), the copy is launched at `start`: no RequestShard. Once it ended the lease word is read
again: still held, the shard landed (it is acknowledged); not, and the ctx began freeing the
blocks during the copy, so the copy is thrown away and the inbound hands off to the asked pull
(`Progress.REVOKED`), whose RequestShard rewrites every byte or is refused.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from helixserve.protocol.disagg import PullGrant
from helixserve.transceiver.cuda_ipc import RemotePools
from helixserve.transceiver.grant import grant_matches
from helixserve.transceiver.gen.transport import Progress, PullTransport, ShardOwner

logger = logging.getLogger(__name__)


class GrantedPull(PullTransport):
    """The copy of a shard on the ctx's grant (see the module docstring)."""

    name: ClassVar[str] = "granted pull"
    has_asked: ClassVar[bool] = False

    def __init__(self, inbound: ShardOwner, pools: RemotePools, grant: PullGrant) -> None:
        super().__init__(inbound, pools)
        self.grant = grant

    def start(self, deadline_s: float) -> bool:
        """Launch the granted copy now; False (nothing launched) when the grant is not usable."""
        pools, grant, inbound = self.pools, self.grant, self.inbound
        if pools.lease is None or grant.epoch != pools.epoch:
            return False  # from another export of that ctx, or no lease words: ask
        if not grant_matches(pools.grant_key, grant, inbound.ticket.ctx_request_id, inbound.plan.spec.num_tokens,
                             inbound.ticket.first_gen_tokens):
            logger.warning("request %s: %s's pull grant does not match the request; asking instead",
                           inbound.request_id, inbound.ctx)
            return False
        if not pools.lease.holds(grant.serial):
            return False  # freed already: RequestShard gets the ctx's own answer
        try:
            self.copy = self.launch(grant.block_ids, None if grant.slot < 0 else grant.slot)
        except Exception as error:  # noqa: BLE001 (nothing launched: ask instead)
            logger.warning("request %s: %s's pull grant is unusable (%s: %s); asking instead", inbound.request_id,
                           inbound.ctx, type(error).__name__, error)
            return False
        return True

    def advance(self) -> Progress | None:
        if self.copy is None or not self.copy.is_done() or self.inbound.error is not None:
            return None
        if not self.is_still_granted():
            return Progress.REVOKED
        self.has_landed = True
        self.inbound.r.num_granted += 1
        return Progress.LANDED

    def is_still_granted(self) -> bool:
        """The ctx holds the grant's blocks now (read after the copy ended: it held them then)."""
        return self.pools.lease is not None and self.pools.lease.holds(self.grant.serial)

    def awaits_ctx(self) -> bool:
        return False  # the copy reads the ctx's pools; nothing more comes from the ctx
