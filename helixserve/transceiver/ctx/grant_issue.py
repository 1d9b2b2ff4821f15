"""ctx: issuing a granted pull of a held request (the grant itself and its MAC: `transceiver.grant`)."""

from __future__ import annotations

from functools import lru_cache

from helixserve.cache_layout import head_slice
from helixserve.protocol.disagg import KVLayout, PullGrant
from helixserve.transceiver import fan
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.grant import make_grant
from helixserve.transceiver.layout import ShardSpec, shard_segments

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
    hold.session.expected_acks = set(fan.targets(layout.num_blocks(hold.num_prompt_tokens), layout.num_kda_heads,
                                                 layout.ctx_rank, layout.ctx_tp_size, cp_size))
    return ""


@lru_cache(maxsize=256)
def request_bytes(layout_json: str, num_tokens: int) -> int:
    """The request's KV + state bytes (without AUX) this ctx rank holds under this layout."""
    layout = KVLayout.model_validate_json(layout_json)
    spec = ShardSpec(layout, num_tokens, ctx_rank=layout.ctx_rank)
    return sum(s.nbytes for s in shard_segments(spec) if s.kind is not PayloadKind.AUX)
