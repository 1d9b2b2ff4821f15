"""A shard's message list per payload kind, as the control plane carries it (PayloadDescriptor):
built by the ctx, checked by the gen rank against its own cut (the ctx's list is untrusted)."""

from __future__ import annotations

from collections.abc import Sequence

from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.base import PayloadKind

KIND_TO_PB = {
    PayloadKind.KV_BLOCKS: pb.PayloadDescriptor.KV_BLOCKS,
    PayloadKind.KDA_STATE: pb.PayloadDescriptor.KDA_STATE,
    PayloadKind.CONV_STATE: pb.PayloadDescriptor.CONV_STATE,
    PayloadKind.AUX: pb.PayloadDescriptor.AUX,
    PayloadKind.DRAFT: pb.PayloadDescriptor.DRAFT,
}
PB_TO_KIND = {v: k for k, v in KIND_TO_PB.items()}


def payload_descriptors(messages: Sequence, kinds: Sequence[PayloadKind]) -> list[pb.PayloadDescriptor]:
    """Describe a plan's messages per payload kind (what the receiver will check)."""
    out = []
    for kind in kinds:
        mine = [m for m in messages if m.kind is kind]
        first = mine[0].index if mine else 0
        out.append(pb.PayloadDescriptor(kind=KIND_TO_PB[kind], first_message=first,
                                        message_nbytes=[m.nbytes for m in mine]))
    return out


def check_payloads(expected: Sequence[pb.PayloadDescriptor], got: Sequence[pb.PayloadDescriptor]) -> None:
    """Reject a sender's (untrusted) message list that differs from ours, naming the difference."""
    ours = {d.kind: (d.first_message, list(d.message_nbytes)) for d in expected}
    theirs: dict[int, tuple[int, list[int]]] = {}
    for d in got:
        if d.kind in theirs:
            raise ValueError(f"sender's plan lists payload {PB_TO_KIND.get(d.kind, d.kind)} twice")
        theirs[d.kind] = (d.first_message, list(d.message_nbytes))
    for kind in sorted(set(ours) | set(theirs)):
        name = PB_TO_KIND[kind].value if kind in PB_TO_KIND else f"kind {kind}"
        if ours.get(kind) != theirs.get(kind):
            mine, other = ours.get(kind), theirs.get(kind)
            raise ValueError(f"sender's plan for {name} differs from ours: "
                             f"{_short(other)} != expected {_short(mine)}")


def _short(entry: tuple[int, list[int]] | None) -> str:
    if entry is None:
        return "missing"
    first, sizes = entry
    return f"first message {first}, {len(sizes)} messages, {sum(sizes)} bytes"
