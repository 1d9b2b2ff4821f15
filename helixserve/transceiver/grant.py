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
import struct
from array import array
from collections.abc import Sequence

from functools import lru_cache

from helixserve.cache_layout import head_slice
from helixserve.protocol.disagg import KVLayout, PullGrant
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.layout import ShardSpec, shard_segments

MAC_BYTES = 16
GRANT_TASK = (-1, PayloadKind.AUX)  # a granted hold's session task (no peer: the acks complete it)


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


def grant_hold(export, hold, serial: int, layout_json: str) -> PullGrant:  # noqa: ANN001
    """ctx, holding the sender's lock: grant a pull of a just-held `hold` (a `sender.Hold`)
    from `export` (its `cuda_ipc.PoolExport`, with a lease board). The hold's session gets a
    task complete from the start, carrying the whole request's bytes, so its acks alone decide."""
    hold.grant_serial = serial
    hold.session.add_task(*GRANT_TASK, request_bytes(layout_json, hold.num_prompt_tokens))
    hold.session.attach(*GRANT_TASK, GRANTED)
    export.lease.grant(serial)
    return make_grant(export.grant_key, hold.session.request_id, hold.num_prompt_tokens, hold.first_tokens,
                      export.epoch, serial, hold.block_ids, hold.slot)


def adopt_cp_group(hold, cp_rank: int, cp_size: int, layout: KVLayout) -> str:  # noqa: ANN001
    """The first ack of a granted hold that no rank asked for names its CP group: expect an
    ack from each of its ranks. An error text ("" if adopted) when the group cannot exist."""
    try:
        head_slice(layout.num_kda_heads, cp_rank, cp_size)  # the CP geometry every shard obeys
    except ValueError as error:
        return f"cp_rank {cp_rank} of cp_size {cp_size} does not fit this request: {error}"
    hold.cp_size = cp_size
    hold.session.expected_acks = set(range(cp_size))
    return ""


@lru_cache(maxsize=256)
def request_bytes(layout_json: str, num_tokens: int) -> int:
    """A whole request's KV + state bytes (without AUX) under this layout."""
    spec = ShardSpec(KVLayout.model_validate_json(layout_json), num_tokens)
    return sum(s.nbytes for s in shard_segments(spec) if s.kind is not PayloadKind.AUX)
