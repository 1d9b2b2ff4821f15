"""Granted pulls: the ctx's leave, carried in its answer, to copy a held prefill without asking.

The ctx (`KVSender.hold`) grants a pull when its pools are exported over CUDA IPC: the grant
(`protocol.disagg.PullGrant`) names the export's epoch, a lease serial (`lease`), the request's
physical blocks and state slot, and an HMAC-SHA256 (truncated to 128 bits) keyed with the
export's random ``grant_key`` over those and the request's id, prompt length and first tokens.
The key reaches only gen ranks that asked DescribePools over the (authenticated) control plane,
so a caller that can reach a gen worker but not the control plane cannot forge a grant that
reads another request's blocks; the router never lets clients set ``disaggregated_params``.

The gen rank (`inbound`) uses a grant only when its opened pools carry that epoch, the MAC
matches the request it serves and the lease word holds the serial; it checks the word again
after its copy ended. Otherwise it asks with RequestShard as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from helixserve.protocol.disagg import PullGrant
from helixserve.transceiver.base import TransferState

MAC_BYTES = 16
GRANT_PEER = -1  # the task of a granted pull (no peer: the acknowledgements complete it)


class _Granted:
    """The handle of a granted pull's task: nothing is sent, nothing reads after a free (the
    lease word is zeroed first), so it is complete and quiesced from the start."""

    error = None

    def test(self) -> TransferState:
        return TransferState.COMPLETED

    def cancel(self) -> None:
        pass

    def is_quiesced(self) -> bool:
        return True


GRANTED = _Granted()


def grant_mac(key: bytes, ctx_request_id: str, num_prompt_tokens: int, first_tokens: Sequence[int], epoch: int,
              serial: int, block_ids: Sequence[int], slot: int) -> str:
    message = "|".join((ctx_request_id, str(num_prompt_tokens), ",".join(map(str, first_tokens)), str(epoch),
                        str(serial), str(slot), ",".join(map(str, block_ids))))
    return hmac.new(key, message.encode(), hashlib.sha256).digest()[:MAC_BYTES].hex()


def make_grant(key: bytes, ctx_request_id: str, num_prompt_tokens: int, first_tokens: Sequence[int], epoch: int,
               serial: int, block_ids: Sequence[int], slot: int | None) -> PullGrant:
    slot_id = -1 if slot is None else int(slot)
    return PullGrant(epoch=epoch, serial=serial, block_ids=list(block_ids), slot=slot_id,
                     mac=grant_mac(key, ctx_request_id, num_prompt_tokens, first_tokens, epoch, serial,
                                   block_ids, slot_id))


def grant_matches(key: bytes, grant: PullGrant, ctx_request_id: str, num_prompt_tokens: int,
                  first_tokens: Sequence[int]) -> bool:
    """The grant was made by the holder of `key` for exactly this request."""
    expected = grant_mac(key, ctx_request_id, num_prompt_tokens, first_tokens, grant.epoch, grant.serial,
                         grant.block_ids, grant.slot)
    return hmac.compare_digest(expected, grant.mac)
