"""ctx -> gen shard mapping: which bytes of a request one receiver gets, and how they travel.

The shard of a receiver with (cp_rank r, cp_size c), for a request of P cached prompt tokens:

- MLA, for every MLA layer: global logical blocks ``b = r, r + c, r + 2c, ... < ceil(P / tpb)``
  (helix ownership, :mod:`helixserve.kvcache.helix`), whole blocks ``[tpb, kv_lora_rank + rope]``.
- KDA, for every KDA layer: heads ``[r*H/c, (r+1)*H/c)`` of the recurrent state ``[H, K, V]``
  (fp32) and of each of the three sections ``q | k | v`` of the conv state ``[3*H*K, W-1]``.
- AUX: the prompt length and the first generated token(s) (checked against the request).
- DRAFT (CP rank 0 only, when the layout names a drafter, ``KVLayout.draft``): a hidden drafter's
  prompt cache, every block of each of its MLA layers (the leader holds the drafter on full rows),
  then its row of target features.

A ctx world of ``ctx_tp_size`` N ranks holds it on several ranks (:mod:`.fan`): each ctx rank s
sends the receiver the part it holds, a stream of its own (:class:`ShardSpec` with ``ctx_rank``
s): the blocks above with ``b % N == s`` and the heads of ``[r*H/c, (r+1)*H/c)`` in
``[s*H/N, (s+1)*H/N)`` (no KDA segments when there are none). At N = 1 that is the whole shard.

**Stream.** The shard is a list of segments in a fixed order: AUX; KDA_STATE per KDA layer;
CONV_STATE per KDA layer; KV_BLOCKS per MLA layer (layers ascending, blocks ascending); DRAFT
(the drafter's layers ascending, then its feature row). A segment
is ``num_units`` equal units (an MLA block, a head slice of a state, a conv section slice). The
stream is cut into messages of at most ``message_bytes`` (:func:`plan_messages`), each a list of
pieces ``(segment, offset, nbytes)`` of consecutive segments of ONE payload kind (what is
accounted per kind, the sender's tasks and the receiver's completion, stays per kind):

- whole units of consecutive segments smaller than the pack limit are packed greedily:
  the AUX word block, the conv states, the KV blocks of short prompts, and the KDA states of a
  shard split over many ranks. Their message count follows their bytes, not the layer count;
- a segment of the pack limit or more starts and ends messages of its own, so it is sent and
  received in place where its memory is one run. A packed message spans several pools and goes
  through a staging copy on each side; on the host that copy runs at about the speed of the
  transfer itself, so a packed byte costs about three times the memory traffic of an in-place
  one, whereas a message costs tens of microseconds. Measured with ``bench/transceiver.py
  --quick`` (kimi-linear-48b, 2 MiB of fp32 state per KDA layer, 2 shared CPU cores): with the
  states packed too (6 messages instead of 29) a 2048-token request to one gen rank took 46 to 54
  ms, with them in place 25 ms, and its paired ratio to a raw ucxx send fell to about 0.3 (0.4 to
  0.65 in place); the 512 KiB states of a gen cp 4 shard, packed, cost its fan-in rows 25 to 50 %,
  the 72 KiB conv states nothing measurable. So on the host the limit is ``ALONE_BYTES`` (1 MiB):
  the large runs (long prompts' blocks, a shard's whole-head states) stay in place and the small
  segments of a shard split over many ranks are packed. On a GPU a staging copy is a device copy,
  far faster than any link, so a receiver there packs every segment and its message count follows
  the bytes alone (:func:`default_pack_bytes`). The limit is part of the cut: the receiver asks
  with it (``transceiver.pack_bytes``, ``ShardRequest.pack_bytes``) and the ctx cuts with it;
- a unit larger than ``message_bytes`` is cut into byte pieces, in messages of their own.

Both sides compute the same cut from the layout and the receiver's ``(message_bytes, pack_bytes)``
(:func:`plan_messages`).

**Memory.** Each side maps every segment to its own tensors (:class:`SegmentMemory`): the ctx
sender to its pools (``H/N`` heads) and the physical blocks of its local blocks, a receiver to its
local-head pools (``H/c`` heads) and its local blocks. Consecutive units that are adjacent in memory are
coalesced, so a message whose bytes are one run is sent / received in place; others (a packed
message, fragmented blocks, a ctx world's every N-th block) are gathered / scattered through a
staging buffer, whole units over many runs by one indexed copy (:meth:`SegmentMemory.copy_out`,
:meth:`SegmentMemory.copy_in`). The map is built by :mod:`memory_map` (per-pool
constants read once, one run list per pool shape shared by its layers); the segment and message
lists of a stream shape are built once and copied (:func:`_stream`). The shard, segment, message
and segment-memory types are :mod:`.segments`' (both this module and :mod:`.memory_map` build on them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.dtypes import dtype_name, itemsize
from helixserve.protocol.disagg import DraftLayout, KVLayout
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver import memory_map
from helixserve.transceiver.segments import Message, Segment, SegmentMemory, ShardSpec

KIND_ORDER = (PayloadKind.AUX, PayloadKind.KDA_STATE, PayloadKind.CONV_STATE, PayloadKind.KV_BLOCKS, PayloadKind.DRAFT)
MESSAGE_INDEX_BITS = 20
MAX_MESSAGES = 1 << MESSAGE_INDEX_BITS
MAX_TAG_BASE = (1 << (64 - MESSAGE_INDEX_BITS)) - 1
AUX_WORDS = 64
AUX_MAGIC = 0x48454C4958  # "HELIX"
MAX_FIRST_TOKENS = AUX_WORDS - 3
ALONE_BYTES = 1 << 20  # a segment this large travels in messages of its own (see the module docstring)


def default_pack_bytes(message_bytes: int, device: torch.device | None) -> int:
    """The pack limit a receiver cuts with when ``transceiver.pack_bytes`` is unset: on a GPU every
    segment is packed (a staging copy there is a device copy, far faster than the link, so the
    message count follows the bytes, not the layers); on the host :data:`ALONE_BYTES` (see the
    module docstring: an in-place byte is cheaper than a message there)."""
    return message_bytes if device is not None and device.type == "cuda" else ALONE_BYTES


def wire_pack_bytes(value: int) -> int:
    """The pack limit a ``pack_bytes`` field of the control plane names (0, unset: ALONE_BYTES)."""
    return value or ALONE_BYTES


def layout_for(cfg, dtype: torch.dtype, tokens_per_block: int, model: str, draft: DraftLayout | None = None) -> KVLayout:
    """The KVLayout of a single-process cache of `cfg` (a KimiModelConfig) in `dtype`; `draft`: the
    prompt cache of the hidden drafter the engine runs, if any."""
    kinds = ["kda" if cfg.is_kda_layer(i) else "mla" for i in range(cfg.num_hidden_layers)]
    name = dtype_name(dtype)
    return KVLayout(
        model=model, tokens_per_block=tokens_per_block, layer_kinds=kinds,
        kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        num_kda_heads=cfg.kda_num_heads, kda_head_dim=cfg.kda_head_dim,
        conv_kernel_size=cfg.conv_kernel_size, kv_dtype=name, state_dtype="float32",
        conv_dtype=name, draft=draft,
    )


def draft_segments(draft: DraftLayout, tokens_per_block: int, num_blocks: int) -> list[Segment]:
    """A drafter's prompt cache in stream order: every block of each of its MLA layers (full
    rows), then its row of target features (layer id -1)."""
    block_bytes = tokens_per_block * (draft.kv_lora_rank + draft.qk_rope_head_dim) * itemsize(draft.kv_dtype)
    return ([Segment(PayloadKind.DRAFT, i, block_bytes, num_blocks) for i in range(draft.num_layers)]
            + [Segment(PayloadKind.DRAFT, -1, draft.feature_size * itemsize(draft.kv_dtype), 1)])


def shard_segments(spec: ShardSpec) -> list[Segment]:
    """The shard's segments in stream order (see the module docstring)."""
    lay = spec.layout
    h = spec.num_heads
    k, w = lay.kda_head_dim, lay.conv_kernel_size - 1
    kda_layers = lay.kda_layers if h else []  # (a ctx rank holding none of the rank's heads sends none)
    segments = [Segment(PayloadKind.AUX, -1, AUX_WORDS * 8, 1)]
    segments += [Segment(PayloadKind.KDA_STATE, i, h * k * k * itemsize(lay.state_dtype), 1)
                 for i in kda_layers]
    segments += [Segment(PayloadKind.CONV_STATE, i, h * k * w * itemsize(lay.conv_dtype), 3)
                 for i in kda_layers]
    block_bytes = lay.tokens_per_block * (lay.kv_lora_rank + lay.qk_rope_head_dim) * itemsize(lay.kv_dtype)
    num_blocks = len(spec.blocks)
    segments += [Segment(PayloadKind.KV_BLOCKS, i, block_bytes, num_blocks) for i in lay.mla_layers]
    if spec.takes_draft:
        assert lay.draft is not None
        segments += draft_segments(lay.draft, lay.tokens_per_block, lay.num_blocks(spec.num_tokens))
    return segments


class _Packer:
    """Builds messages of pieces of one kind, at most `message_bytes` each (see `plan_messages`)."""

    def __init__(self, message_bytes: int) -> None:
        self.message_bytes = message_bytes
        self.messages: list[Message] = []
        self.kind: PayloadKind | None = None
        self.pieces: list[tuple[int, int, int]] = []
        self.nbytes = 0

    def room(self, kind: PayloadKind) -> int:
        """Bytes the open message can still take for `kind` (a new kind closes it)."""
        if kind is not self.kind:
            self.close()
            self.kind = kind
        return self.message_bytes - self.nbytes

    def add(self, segment: int, offset: int, nbytes: int) -> None:
        self.pieces.append((segment, offset, nbytes))
        self.nbytes += nbytes

    def close(self) -> None:
        if self.pieces:
            self.messages.append(Message(len(self.messages), self.kind, tuple(self.pieces), self.nbytes))
        self.pieces, self.nbytes = [], 0


def plan_messages(segments: Sequence[Segment], message_bytes: int, alone_bytes: int = ALONE_BYTES) -> list[Message]:
    """Cut the stream into messages of at most `message_bytes` (see the module docstring): whole
    units of consecutive segments of one kind packed greedily; a segment of `alone_bytes` or more
    in messages of its own; a unit larger than a message cut into byte pieces."""
    if message_bytes < 1:
        raise ValueError(f"message_bytes must be >= 1, got {message_bytes}")
    packer = _Packer(message_bytes)
    for index, seg in enumerate(segments):
        is_alone = seg.nbytes >= alone_bytes
        if is_alone:
            packer.close()
        step = min(seg.unit_bytes, message_bytes)  # a unit, or a byte piece of a larger one
        offset = 0
        while offset < seg.nbytes:
            take = min(packer.room(seg.kind) // step * step, seg.nbytes - offset)
            if take == 0:
                packer.close()
                continue
            packer.add(index, offset, take)
            offset += take
        if is_alone:
            packer.close()
    packer.close()
    if len(packer.messages) > MAX_MESSAGES:
        raise ValueError(f"{len(packer.messages)} messages > {MAX_MESSAGES}: raise message_bytes")
    return packer.messages


def wire_tag(tag_base: int, message_index: int) -> int:
    if not 0 <= tag_base <= MAX_TAG_BASE or not 0 <= message_index < MAX_MESSAGES:
        raise ValueError(f"tag base {tag_base} / message index {message_index} out of range")
    return (tag_base << MESSAGE_INDEX_BITS) | message_index


_STREAMS: dict[tuple, tuple[list[Segment], list[Message]]] = {}  # see _stream
_STREAMS_LOCK = threading.Lock()  # a miss (insert, evict): the engine and the sender's threads plan
MAX_STREAMS = 256


def _stream(spec: ShardSpec, num_blocks: int, message_bytes: int,
            pack_bytes: int) -> tuple[list[Segment], list[Message]]:
    """(shard_segments(spec), plan_messages(them, message_bytes, pack_bytes)), new lists of the same frozen
    items for every spec of one shape (what the two depend on: layer kinds, sizes, dtypes, local
    heads, block count): a request's plan does not rebuild its stream's ~2 objects per layer."""
    lay = spec.layout
    key = (tuple(lay.layer_kinds), lay.tokens_per_block, lay.kv_lora_rank, lay.qk_rope_head_dim, lay.kv_dtype,
           lay.kda_head_dim, lay.conv_kernel_size, lay.state_dtype, lay.conv_dtype, spec.num_heads,
           num_blocks, message_bytes, pack_bytes, lay.draft if spec.takes_draft else None,
           lay.num_blocks(spec.num_tokens) if spec.takes_draft else 0)
    stream = _STREAMS.get(key)
    if stream is None:
        segments = shard_segments(spec)
        stream = (segments, plan_messages(segments, message_bytes, pack_bytes))
        with _STREAMS_LOCK:
            if len(_STREAMS) >= MAX_STREAMS:
                _STREAMS.pop(next(iter(_STREAMS)), None)  # the oldest
            _STREAMS[key] = stream
    return list(stream[0]), list(stream[1])


def encode_aux(num_prompt_tokens: int, first_tokens: Sequence[int]) -> torch.Tensor:
    """AUX payload: int64 ``[magic, num_prompt_tokens, n, first_tokens..., 0...]`` (AUX_WORDS)."""
    if not 1 <= len(first_tokens) <= MAX_FIRST_TOKENS:
        raise ValueError(f"need 1..{MAX_FIRST_TOKENS} first tokens, got {len(first_tokens)}")
    words = [AUX_MAGIC, num_prompt_tokens, len(first_tokens), *first_tokens]
    return torch.tensor(words + [0] * (AUX_WORDS - len(words)), dtype=torch.int64)


def decode_aux(aux: torch.Tensor) -> tuple[int, list[int]]:
    """(num_prompt_tokens, first_tokens); ValueError on a malformed payload."""
    words = aux.tolist()
    if words[0] != AUX_MAGIC or not 1 <= words[2] <= MAX_FIRST_TOKENS:
        raise ValueError(f"malformed AUX payload (magic {words[0]:#x}, {words[2]} first tokens)")
    return words[1], words[3 : 3 + words[2]]


@dataclass(slots=True)
class ShardPlan:
    """A shard's segments, messages and this side's memory for each segment.

    The memory map is built on first use (`prepare()`, or the first `spans()`), so a side can
    answer or ask first and map its memory while the peer works.
    """

    spec: ShardSpec
    segments: list[Segment]
    messages: list[Message]
    map_memory: object  # () -> list[SegmentMemory]
    aux: torch.Tensor
    message_bytes: int
    pack_bytes: int = ALONE_BYTES
    _memory: list[SegmentMemory] | None = None

    @property
    def cut(self) -> tuple[int, int]:
        """``(message_bytes, pack_bytes)``: what both sides cut the stream with."""
        return self.message_bytes, self.pack_bytes

    @property
    def memory(self) -> list[SegmentMemory]:
        if self._memory is None:
            self._memory = self.map_memory()
        return self._memory

    def prepare(self) -> ShardPlan:
        self.memory  # noqa: B018 - builds the map now
        return self

    @classmethod
    def for_sender(cls, spec: ShardSpec, caches: ModelCaches, block_ids: Sequence[int], slot: int | None,
                   first_tokens: Sequence[int], message_bytes: int, pack_bytes: int = ALONE_BYTES) -> ShardPlan:
        """The ctx rank's side: pools of its ``H/ctx_tp_size`` heads, ``block_ids[k]`` holding its
        k-th local block (global ``ctx_rank + k*ctx_tp_size``; logical block k at ``ctx_tp_size`` 1;
        a drafter's pages too: a ctx that drafts is one rank)."""
        blocks = spec.blocks
        n = spec.layout.ctx_tp_size
        first, last = blocks[0] // n if blocks else 0, blocks[-1] // n if blocks else -1
        if last >= len(block_ids):
            raise ValueError(f"shard needs logical block {blocks[-1]} (local block {last}), the request holds "
                             f"{len(block_ids)}")
        aux = encode_aux(spec.num_tokens, first_tokens)
        segments, messages = _stream(spec, len(blocks), message_bytes, pack_bytes)
        physical = list(block_ids[first : last + 1 : spec.block_step // n])

        def map_memory() -> list[SegmentMemory]:
            return memory_map.map_memory(spec, segments, caches, aux, physical, slot, spec.num_ctx_heads, spec.ctx_head0,
                                         block_ids)
        return cls(spec, segments, messages, map_memory, aux, message_bytes, pack_bytes)

    @classmethod
    def for_receiver(cls, spec: ShardSpec, caches: ModelCaches, local_block_ids: Sequence[int],
                     slot: int | None, message_bytes: int, pack_bytes: int = ALONE_BYTES,
                     draft_blocks: Sequence[int] = ()) -> ShardPlan:
        """A gen rank: pools of its ``H/cp_size`` heads; ``local_block_ids[k]`` holds its k-th local
        block (global ``cp_rank + k*cp_size``: at ``ctx_tp_size`` 1 the k-th shard block);
        ``draft_blocks``: the drafter's pages of the request (its full-row table, when
        ``spec.takes_draft``)."""
        blocks = spec.blocks
        first, end = (blocks[0] // spec.cp_size, blocks[-1] // spec.cp_size + 1) if blocks else (0, 0)
        if len(local_block_ids) < end:
            raise ValueError(f"shard has {end} blocks, the handle holds {len(local_block_ids)}")
        aux = torch.zeros(AUX_WORDS, dtype=torch.int64)
        segments, messages = _stream(spec, len(blocks), message_bytes, pack_bytes)
        physical = list(local_block_ids[first:end:spec.block_step // spec.cp_size])

        def map_memory() -> list[SegmentMemory]:
            return memory_map.map_memory(spec, segments, caches, aux, physical, slot, spec.num_local_heads,
                                         spec.gen_head0, draft_blocks)
        return cls(spec, segments, messages, map_memory, aux, message_bytes, pack_bytes)

    def spans(self, message: Message) -> list[torch.Tensor]:
        """Views of the message's bytes on this side, in stream order (one: it goes in place)."""
        memory = self.memory
        if len(message.pieces) == 1:
            segment, offset, nbytes = message.pieces[0]
            return memory[segment].spans(offset, nbytes)
        return [span for segment, offset, nbytes in message.pieces for span in memory[segment].spans(offset, nbytes)]

    def in_place(self, message: Message) -> torch.Tensor | None:
        """The one view holding the message's bytes on this side (sent / received in place), or
        None: they are in several runs (a packed message, fragmented blocks) and are staged."""
        if len(message.pieces) > 1:
            return None
        segment, offset, nbytes = message.pieces[0]
        memory = self.memory[segment]
        return memory.spans(offset, nbytes)[0] if memory.num_runs(offset, nbytes) == 1 else None

    def device(self, message: Message) -> torch.device:
        return self.memory[message.pieces[0][0]].flat.device

    def gather(self, message: Message, out: torch.Tensor) -> None:
        """Copy the message's bytes on this side into `out` (uint8, ``message.nbytes``)."""
        start = 0
        for segment, offset, nbytes in message.pieces:
            self.memory[segment].copy_out(offset, nbytes, out[start : start + nbytes])
            start += nbytes

    def scatter(self, src: torch.Tensor, message: Message) -> None:
        """Copy `src` (uint8, ``message.nbytes``) into the message's bytes on this side."""
        start = 0
        for segment, offset, nbytes in message.pieces:
            self.memory[segment].copy_in(src[start : start + nbytes], offset, nbytes)
            start += nbytes

    def kind_messages(self, kind: PayloadKind) -> list[Message]:
        return [m for m in self.messages if m.kind is kind]

    @property
    def kinds(self) -> list[PayloadKind]:
        present = {seg.kind for seg in self.segments}
        return [k for k in KIND_ORDER if k in present]

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self.segments)
