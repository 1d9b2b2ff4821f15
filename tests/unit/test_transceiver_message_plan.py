"""The message plan of a shard stream (`layout.plan_messages`) over random streams and message
sizes: every byte of every segment in exactly one message, in stream order; messages of one kind,
whole units where a unit fits, at most `message_bytes`; a count that follows the bytes, not the
layers."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helixserve.models.presets import get_preset
from helixserve.transceiver.layout import (ALONE_BYTES, KIND_ORDER, ShardSpec, default_pack_bytes, layout_for,
                                         plan_messages, shard_segments)
from helixserve.transceiver.segments import Message, Segment

TARGET_KINDS = KIND_ORDER[:-1]  # (the last: a drafter's prompt cache, in no shard here)

CFG = get_preset("kimi-k3-tiny")
LAYOUT = layout_for(CFG, torch.float32, 4, "kimi-k3-tiny")

segment_lists = st.lists(st.tuples(st.sampled_from(KIND_ORDER), st.integers(1, 300), st.integers(0, 6)),
                         min_size=1, max_size=24).map(
    lambda specs: [Segment(kind, i, unit, n)
                   for i, (kind, unit, n) in enumerate(sorted(specs, key=lambda s: KIND_ORDER.index(s[0])))])


def covered_bytes(segments: list[Segment], messages: list[Message]) -> None:
    """Every byte of every segment in exactly one piece: the pieces, in message order, run through
    the non-empty segments in stream order, each from its first byte to its last, back to back."""
    runs: list[list[tuple[int, int]]] = []  # per segment met: its pieces' (offset, nbytes)
    order: list[int] = []
    for segment, offset, nbytes in (p for m in messages for p in m.pieces):
        if not order or order[-1] != segment:
            order.append(segment)
            runs.append([])
        runs[-1].append((offset, nbytes))
    assert order == [i for i, seg in enumerate(segments) if seg.nbytes]
    for segment, pieces in zip(order, runs, strict=True):
        ends = [0]
        for offset, nbytes in pieces:
            assert offset == ends[-1] and nbytes > 0
            ends.append(offset + nbytes)
        assert ends[-1] == segments[segment].nbytes


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(segments=segment_lists, message_bytes=st.integers(1, 2000), alone_bytes=st.integers(1, 3000))
def test_every_byte_travels_once_in_order_in_messages_of_one_kind(segments, message_bytes, alone_bytes):
    messages = plan_messages(segments, message_bytes, alone_bytes)
    covered_bytes(segments, messages)
    assert [m.index for m in messages] == list(range(len(messages)))
    for m in messages:
        assert 0 < m.nbytes <= message_bytes and m.nbytes == sum(n for _, _, n in m.pieces)
        assert {segments[s].kind for s, _, _ in m.pieces} == {m.kind}
        for s, offset, nbytes in m.pieces:
            unit = segments[s].unit_bytes
            if unit <= message_bytes:  # whole units; a larger unit is cut into byte pieces
                assert offset % unit == 0 and nbytes % unit == 0
            if segments[s].nbytes >= alone_bytes:  # a large segment: messages of its own
                assert {p[0] for p in m.pieces} == {s}
    # the count follows the bytes: a message closed for room holds over half a message, except the
    # last of a large segment (or of one cut into byte pieces) and one such a segment closes early
    kinds = {seg.kind for seg in segments if seg.nbytes}
    odd = sum(1 for seg in segments if seg.nbytes and (seg.nbytes >= alone_bytes or seg.unit_bytes > message_bytes))
    total = sum(seg.nbytes for seg in segments)
    assert len(messages) <= len(kinds) + 2 * total / message_bytes + 2 * odd


def layers(num_layers: int) -> list[str]:
    return ["mla" if i % 4 == 3 else "kda" for i in range(num_layers)]


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_tokens=st.integers(1, 200), cp=st.sampled_from([(0, 1), (1, 2), (3, 4)]))
def test_the_message_count_does_not_grow_with_the_layers(num_tokens, cp):
    """The same prompt over 4 and 16 layers: one message per kind while a kind's bytes fit a message."""
    small, large = (ShardSpec(LAYOUT.model_copy(update={"layer_kinds": layers(n)}), num_tokens, *cp) for n in (4, 16))
    message_bytes = sum(seg.nbytes for seg in shard_segments(large))
    counts = [len(plan_messages(shard_segments(spec), message_bytes)) for spec in (small, large)]
    kinds = {seg.kind for seg in shard_segments(large) if seg.nbytes}
    assert counts == [len(kinds), len(kinds)]


def test_a_long_model_stays_at_its_bytes():
    """A 1-token prompt over 60 layers (45 KDA, 15 MLA): 106 segments, one message per kind."""
    spec = ShardSpec(LAYOUT.model_copy(update={"layer_kinds": layers(60)}), 1)
    segments = shard_segments(spec)
    assert len(segments) == 106
    assert [m.kind for m in plan_messages(segments, 1 << 20)] == list(TARGET_KINDS)


def test_a_receiver_on_a_gpu_packs_every_segment_and_one_on_the_host_from_1_mib():
    """The default pack limit: the message size on a GPU (every segment packed: a 60-layer stream of
    a 1-token prompt is one message per kind even with 2 MiB states), 1 MiB on the host."""
    assert default_pack_bytes(16 << 20, torch.device("cuda", 0)) == 16 << 20
    assert default_pack_bytes(16 << 20, torch.device("cpu")) == default_pack_bytes(16 << 20, None) == ALONE_BYTES
    wide = LAYOUT.model_copy(update={"layer_kinds": layers(60), "num_kda_heads": 32, "kda_head_dim": 128})
    segments = shard_segments(ShardSpec(wide, 1))
    assert max(seg.nbytes for seg in segments) == 2 << 20  # a state: 32 heads of 128 x 128 fp32
    message_bytes = sum(seg.nbytes for seg in segments)
    packed = plan_messages(segments, message_bytes, default_pack_bytes(message_bytes, torch.device("cuda", 0)))
    assert [m.kind for m in packed] == list(TARGET_KINDS)
    alone = plan_messages(segments, message_bytes, default_pack_bytes(message_bytes, None))
    assert len(alone) == 45 + 3  # each state alone; AUX, the conv states, the KV blocks packed
