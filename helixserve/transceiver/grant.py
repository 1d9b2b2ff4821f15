"""Granted pulls: the ctx's leave, carried in its answer, to copy a held prefill without asking.

The ctx (`KVSender.hold`) grants a pull when its pools are exported over CUDA IPC: the grant
(`protocol.disagg.PullGrant`) names the export's epoch, a lease serial (`lease`), the request's
physical blocks and state slot, and an HMAC-SHA256 (truncated to 128 bits) keyed with the
export's random ``grant_key`` over those and the request's id, prompt length and first tokens.
The key reaches only gen ranks that asked DescribePools over the (authenticated) control plane,
so a caller that can reach a gen worker but not the control plane cannot forge a grant that
reads another request's blocks; the router never lets clients set ``disaggregated_params``.

The gen rank (`gen.granted_pull`) uses a grant only when its opened pools carry that epoch, the MAC
matches the request it serves and the lease word holds the serial; it checks the word again
after its copy ended. Otherwise it asks with RequestShard as before.

This module is the grant's MAC, which both sides compute; the ctx issues grants with
`ctx.grant_issue`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from array import array
from collections.abc import Sequence

from helixserve.protocol.disagg import PullGrant

MAC_BYTES = 16


def grant_mac(key: bytes, ctx_request_id: str, num_prompt_tokens: int, first_tokens: Sequence[int], epoch: int,
              serial: int, block_ids: Sequence[int], slot: int) -> str:
    """The MAC over a fixed-width encoding (lengths first, then the ids as int64 words): no
    separator to escape, and a 32k-token request's 512 block ids cost one C-level conversion."""
    rid = ctx_request_id.encode()
    head = struct.pack("<6q", len(rid), num_prompt_tokens, epoch, serial, slot, len(first_tokens))
    message = b"".join((head, rid, array("q", first_tokens).tobytes(), array("q", block_ids).tobytes()))
    return hmac.new(key, message, hashlib.sha256).digest()[:MAC_BYTES].hex()


def make_grant(key: bytes, ctx_request_id: str, num_prompt_tokens: int, first_tokens: Sequence[int], epoch: int,
               serial: int, block_ids: Sequence[int], slot: int | None) -> PullGrant:
    slot_id = -1 if slot is None else int(slot)
    return PullGrant(epoch=epoch, serial=serial, block_ids=list(block_ids), slot=slot_id,
                     mac=grant_mac(key, ctx_request_id, num_prompt_tokens, first_tokens, epoch, serial,
                                   block_ids, slot_id))


def grant_matches(key: bytes, grant: PullGrant, ctx_request_id: str, num_prompt_tokens: int,
                  first_tokens: Sequence[int]) -> bool:
    """The grant was made by the holder of `key` for exactly this request (False also for values
    no grant can carry: outside int64)."""
    try:
        expected = grant_mac(key, ctx_request_id, num_prompt_tokens, first_tokens, grant.epoch, grant.serial,
                             grant.block_ids, grant.slot)
    except (OverflowError, struct.error):
        return False
    return hmac.compare_digest(expected, grant.mac)
