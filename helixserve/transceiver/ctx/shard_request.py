"""The ctx's checks of a gen rank's RequestShard against the request it holds (untrusted input)."""

from __future__ import annotations

from pydantic import ValidationError

from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import KVLayout
from helixserve.transceiver.layout import MAX_TAG_BASE, ShardSpec
from helixserve.transceiver.layout_match import LayoutMismatchError, check_layout, check_mapping

MIN_ADDRESS_BYTES, MAX_ADDRESS_BYTES = 16, 1 << 16  # a sanity bound only: UCX trusts addresses


def check_shard_request(hold, request: pb.ShardRequest, who: str, layout: KVLayout, message_bytes: int) -> ShardSpec:  # noqa: ANN001
    """The ShardSpec a RequestShard asks for from `hold` (a held request), or ValueError naming
    what is wrong: a settled hold, a malformed or different layout (another ctx world size or
    rank than this sender's, heads that do not split over its cp_size), a gen rank this ctx rank
    holds nothing of, another prompt length or CP geometry, a duplicate cp rank, a malformed address, tag base or message size.
    The drafter's prompt cache (``layout.draft``) is in the shard when the gen rank asks for it."""
    state = hold.session.state
    if state.is_settled:
        raise ValueError(f"ctx request {request.ctx_request_id} is {state.value}: {hold.session.error}")
    try:
        theirs = KVLayout.model_validate_json(request.layout_json)
    except ValidationError as error:
        raise ValueError(f"malformed KV layout from {who}: {error}") from None
    try:
        check_layout(layout, theirs, "ctx", who, mapping=True)  # the ctx rank it asks is this one
        check_mapping(layout, who, request.cp_rank, request.cp_size)
    except LayoutMismatchError as error:
        raise ValueError(str(error)) from None
    if request.num_prompt_tokens != hold.num_prompt_tokens:
        raise ValueError(f"{who} expects {request.num_prompt_tokens} prompt tokens, the ctx request "
                         f"has {hold.num_prompt_tokens}")
    if hold.cp_size not in (None, request.cp_size):
        raise ValueError(f"{who}: request already picked up with cp_size {hold.cp_size}")
    if request.cp_rank in hold.outbounds:
        raise ValueError(f"{who}: cp_rank {request.cp_rank} already picked this request up")
    if not MIN_ADDRESS_BYTES <= len(request.ucx_worker_address) <= MAX_ADDRESS_BYTES:
        raise ValueError(f"{who}: malformed UCX worker address ({len(request.ucx_worker_address)} bytes)")
    if request.tag_base > MAX_TAG_BASE or request.max_message_bytes < 1:
        raise ValueError(f"{who}: tag_base {request.tag_base} or max_message_bytes "
                         f"{request.max_message_bytes} out of range")
    if request.max_message_bytes > message_bytes:  # its receives are already posted
        raise ValueError(f"{who} cuts the stream into messages of {request.max_message_bytes} bytes, more "
                         f"than this ctx's message_bytes {message_bytes}: configure "
                         "the same transceiver.message_bytes on both sides")
    if theirs.draft != layout.draft:  # (check_layout: it asks for none) the drafter's cache stays here
        layout = layout.model_copy(update={"draft": None})
    spec = ShardSpec(layout, hold.num_prompt_tokens, request.cp_rank, request.cp_size, layout.ctx_rank)
    if not spec.blocks and not spec.num_heads:
        raise ValueError(f"{who} needs nothing ctx rank {layout.ctx_rank} of {layout.ctx_tp_size} holds "
                         f"(no block of its {hold.num_prompt_tokens}-token prompt, no KDA head)")
    return spec
