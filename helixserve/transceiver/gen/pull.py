"""A pulled shard: the receiver copies its bytes out of the ctx's opened pools (see `cuda_ipc`).

The shard is the bytes `layout` names for this receiver (see the `layout` module docstring):
every MLA layer's blocks, every KDA layer's state and conv head slices, and on the CP group's
leader a hidden drafter's prompt cache when the ctx exports one (``ModelCaches.draft``: its pages
of every block, out of the ctx's block table into the leader's full-row table, and its feature
row, slot to slot; :attr:`PullPair.moves_draft`). In the pools those are
three groups of equal units repeated over layers (a block at the same ids in every MLA layer;
a head slice at the same slot in every KDA layer), which is what one unit copy takes
(`kernels.copy.units`): the per-layer pool pairs (a :class:`PullPair`, checked once per pair of
pool sets) and, per request, the unit offsets (the two block tables times the block size, the
two slots). The device computes every address, so the host's work does not grow with the layer
count, and no memory map or piece table is built. From a ctx world of tp N each ctx rank's pools
are opened apart (each rank has its own endpoint) and each gen rank copies, out of each rank
holding part of its shard, that part (:mod:`..fan`): the blocks ``b % N`` names (the rank's local
block ``b // N``) and the heads both ranks hold (at their offsets in either side's pools).

The copy runs on the device's current stream (the engine's compute stream), behind the work
queued there (the destination blocks may have been read by the previous owner's last step);
the next step's kernels queue behind the copy, which takes 10–170 µs for 7–293 MiB on an H200.
An event tells the engine thread when it is done; `wait` bounds how long a receiver that gives
up waits for a copy already launched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from helixserve.cache_layout import ModelCaches
from helixserve.dtypes import torch_dtype
from helixserve.kernels.copy.units import UnitCopier, UnitGroup, unit_copy
from helixserve.transceiver.layout import ShardSpec
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.memory_map import PoolInfo, _checked, _unit_offsets

WAIT_TICK_S = 0.0002  # internal: the bounded wait for a launched copy polls its event this often
MAX_PAIRS = 8  # PullPairs kept per cache (a gen rank pulls into one cache set; a few ctx exports)
MAX_SLOT_UNITS = 4096  # a PullPair's remembered KDA unit groups, by (ctx slot, our slot, first head)


class _Kind:
    """One cache kind's layers on both sides: their flat pools' indices, by pool geometry."""

    def __init__(self) -> None:
        self.by_geometry: dict[tuple[int, int], tuple[PoolInfo, PoolInfo, list[tuple[int, int]]]] = {}
        self.segments: list[np.ndarray] = []  # per geometry: [layers, 2] (source, destination index)

    def add(self, src: PoolInfo, si: int, dst: PoolInfo, di: int) -> None:
        entry = self.by_geometry.setdefault((src.geometry, dst.geometry), (src, dst, []))
        entry[2].append((si, di))

    def seal(self) -> None:
        self.segments = [np.asarray(pairs, dtype=np.int64) for _, _, pairs in self.by_geometry.values()]

    def groups(self, unit_bytes: int, units: np.ndarray, align: int = 0) -> list[UnitGroup]:
        return [UnitGroup(unit_bytes, segments, units, align) for segments in self.segments]

    def infos(self) -> list[tuple[PoolInfo, PoolInfo]]:
        return [(s, d) for s, d, _ in self.by_geometry.values()]


class PullPair:
    """Pulls out of one pool set (`src`: a ctx rank's pools, of ``H / ctx_tp_size`` KDA heads)
    into another (`dst`: this rank's pools of `dst_heads` KDA heads): every layer's pools checked
    against the layout (the refusals `memory_map` gives) and their flat views, once."""

    def __init__(self, layout, src: ModelCaches, dst: ModelCaches, dst_heads: int) -> None:  # noqa: ANN001 (KVLayout)
        self.layout, self.src_caches, self.dst_caches, self.dst_heads = layout, src, dst, dst_heads
        k = layout.kda_head_dim
        h = self.src_heads = layout.num_kda_heads // layout.ctx_tp_size
        rows = layout.kv_lora_rank + layout.qk_rope_head_dim
        self.srcs: list[torch.Tensor] = []
        self.dsts: list[torch.Tensor] = []
        self._tensors: list[torch.Tensor] = []  # the pools read (kept alive: `identity` compares their ids)
        self.mla, self.state, self.conv = _Kind(), _Kind(), _Kind()
        specs = [(self.mla, "mla_kv", layout.mla_layers, layout.kv_dtype, (layout.tokens_per_block, rows),
                  (layout.tokens_per_block, rows)),
                 (self.state, "kda_state", layout.kda_layers, layout.state_dtype, (h, k, k), (dst_heads, k, k)),
                 (self.conv, "conv_state", layout.kda_layers, layout.conv_dtype, (3 * h * k, layout.conv_kernel_size - 1),
                  (3 * dst_heads * k, layout.conv_kernel_size - 1))]
        pools = [(kind, getattr(src, name), getattr(dst, name), layers, dtype, src_inner, dst_inner)
                 for kind, name, layers, dtype, src_inner, dst_inner in specs]
        # a hidden drafter's prompt cache, where both sides hold it: its pages, its feature rows
        self.draft, self.features = _Kind(), _Kind()
        draft = layout.draft
        self.moves_draft = draft is not None and src.draft is not None and dst.draft is not None
        if self.moves_draft:
            page = (layout.tokens_per_block, draft.kv_lora_rank + draft.qk_rope_head_dim)
            pools += [(self.draft, src.draft.mla_kv, dst.draft.mla_kv, range(draft.num_layers), draft.kv_dtype, page,
                       page),
                      (self.features, {0: src.draft.features}, {0: dst.draft.features}, [0], draft.kv_dtype,
                       (draft.feature_size,), (draft.feature_size,))]
        for kind, src_pools, dst_pools, layers, dtype, src_inner, dst_inner in pools:
            for layer in layers:
                s = self._flat(self.srcs, src_pools, layer, dtype, src_inner)
                d = self._flat(self.dsts, dst_pools, layer, dtype, dst_inner)
                kind.add(s, len(self.srcs) - 1, d, len(self.dsts) - 1)
            kind.seal()
        self._identity = (src.identity(), dst.identity())
        self.copier = UnitCopier(self.srcs, self.dsts, [*self.mla.segments, *self.state.segments, *self.conv.segments,
                                                        *self.draft.segments, *self.features.segments], graphs=True)
        # per request, only these are read: the pools' sizes (range checks) and unit strides
        self._blocks = _limits(self.mla.infos())
        self._slots = _limits(self.state.infos() + self.conv.infos())
        self._draft_limits = (_limits(self.draft.infos()), _limits(self.features.infos()))
        self._head_units: dict[tuple[int, int, int], list[UnitGroup]] = {}  # (src slot, dst slot, head0)

    def _flat(self, flats: list[torch.Tensor], pools: dict, layer: int, dtype: str, inner: tuple[int, ...]) -> PoolInfo:
        info = _checked(pools, layer, dtype, torch_dtype(dtype), inner)
        if info.flat is None:
            raise ValueError(f"cache tensor {info.shape} must be contiguous")
        flats.append(info.flat)
        self._tensors.append(pools[layer])
        return info

    def is_current(self) -> bool:
        """Every pool of both cache sets is still the tensor this pair was built over (those
        tensors live in `_tensors`, so equal ids are the same tensors)."""
        return (self.src_caches.identity(), self.dst_caches.identity()) == self._identity

    def groups(self, spec: ShardSpec, src_block_ids: Sequence[int], src_slot: int | None,
               dst_block_ids: Sequence[int], dst_slot: int | None, draft_blocks: Sequence[int] = ()) -> list[UnitGroup]:
        """The unit groups of `spec`'s shard: the ctx rank holds its k-th local block (global
        ``ctx_rank + k*ctx_tp_size``) at ``src_block_ids[k]`` and its KDA state at `src_slot`;
        this rank's k-th local block (global ``cp_rank + k*cp_size``) is ``dst_block_ids[k]``,
        its state slot `dst_slot`; a drafter's prompt cache (``spec.takes_draft`` and
        `moves_draft`) goes from the ctx's pages ``src_block_ids`` to ``draft_blocks`` (this
        rank's full-row table) and from slot to slot. ValueError naming a block id or slot outside
        its pool, or a shard the block tables do not cover."""
        if spec.layout is not self.layout and spec.layout != self.layout:
            raise ValueError("the shard's layout is not the one these pools were checked against")
        if spec.num_local_heads != self.dst_heads:
            raise ValueError(f"the shard has {spec.num_local_heads} KDA heads, this rank's pools {self.dst_heads}")
        groups: list[UnitGroup] = []
        blocks = np.asarray(spec.blocks, dtype=np.int64)
        if blocks.size and self.mla.by_geometry:
            src = _local(src_block_ids, blocks // spec.layout.ctx_tp_size, blocks[-1], "the request holds")
            dst = _local(dst_block_ids, blocks // spec.cp_size, blocks[-1], "the handle holds")
            _in_range("block id", src, self._blocks[0], "the ctx's")
            _in_range("block id", dst, self._blocks[1], "this rank's")
            s, d = self.mla.infos()[0]
            units = np.empty((len(src), 2), dtype=np.int64)
            units[:, 0] = _unit_offsets(PayloadKind.KV_BLOCKS, s, src, 0, 0, 0, 0)
            units[:, 1] = _unit_offsets(PayloadKind.KV_BLOCKS, d, dst, 0, 0, 0, 0)
            # every offset is a block id times a block's stride on its side
            groups += self.mla.groups(s.strides[0] * s.itemsize, units,
                                      (s.strides[0] * s.itemsize) | (d.strides[0] * d.itemsize))
        if self.state.by_geometry and spec.num_heads:
            if src_slot is None or dst_slot is None:
                raise ValueError("a KDA shard needs a state slot on both sides")
            key = (src_slot, dst_slot, spec.ctx_head0, spec.gen_head0, spec.num_heads)
            head_groups = self._head_units.get(key)
            if head_groups is None:
                head_groups = self._head_groups(*key)
                if len(self._head_units) >= MAX_SLOT_UNITS:
                    self._head_units.clear()
                self._head_units[key] = head_groups
            groups += head_groups
        if spec.takes_draft and self.moves_draft:
            groups += self._draft_groups(spec, src_block_ids, src_slot, draft_blocks, dst_slot)
        return groups

    def _draft_groups(self, spec: ShardSpec, src_block_ids: Sequence[int], src_slot: int | None,
                      draft_blocks: Sequence[int], dst_slot: int | None) -> list[UnitGroup]:
        """The drafter's pages of every block of the request and its feature row (a ctx that drafts
        is one rank: its local blocks are the logical ones)."""
        if src_slot is None or dst_slot is None:
            raise ValueError("a drafter's feature row needs a state slot on both sides")
        blocks = np.arange(spec.layout.num_blocks(spec.num_tokens), dtype=np.int64)
        (src_pages, dst_pages), (src_rows, dst_rows) = self._draft_limits
        groups: list[UnitGroup] = []
        for kind, ids, limits in ((self.draft, (_local(src_block_ids, blocks, blocks[-1], "the request holds"),
                                                _local(draft_blocks, blocks, blocks[-1], "the drafter's table holds")),
                                   (src_pages, dst_pages)),
                                  (self.features, (np.asarray([src_slot]), np.asarray([dst_slot])), (src_rows, dst_rows))):
            _in_range("drafter page or slot", ids[0], limits[0], "the ctx's")
            _in_range("drafter page or slot", ids[1], limits[1], "this rank's")
            s, d = kind.infos()[0]
            rows = (s.strides[0] * s.itemsize, d.strides[0] * d.itemsize)
            units = np.stack([ids[0] * rows[0], ids[1] * rows[1]], axis=1)
            groups += kind.groups(rows[0], units, rows[0] | rows[1])
        return groups

    def _head_groups(self, src_slot: int, dst_slot: int, src_head0: int, dst_head0: int,
                     num_heads: int) -> list[UnitGroup]:
        """The KDA state and conv groups of heads ``[src_head0, +num_heads)`` of the ctx rank's
        slot to ``[dst_head0, +num_heads)`` of this rank's."""
        _in_range("state slot", np.asarray([src_slot]), self._slots[0], "the ctx's")
        _in_range("state slot", np.asarray([dst_slot]), self._slots[1], "this rank's")
        k = self.layout.kda_head_dim
        groups: list[UnitGroup] = []
        for kind, payload, unit_elems in ((self.state, PayloadKind.KDA_STATE, k * k),
                                          (self.conv, PayloadKind.CONV_STATE, k * (self.layout.conv_kernel_size - 1))):
            s, d = kind.infos()[0]  # (the tagged stream's offsets: one state slice, three conv sections)
            units = np.stack([np.asarray(_unit_offsets(payload, s, (), src_slot, self.src_heads, src_head0, k),
                                         dtype=np.int64),
                              np.asarray(_unit_offsets(payload, d, (), dst_slot, self.dst_heads, dst_head0, k),
                                         dtype=np.int64)], axis=1)
            groups += kind.groups(num_heads * unit_elems * d.itemsize, units, int(np.bitwise_or.reduce(units.ravel())))
        return groups


def _local(block_ids: Sequence[int], local: np.ndarray, last: int, whose: str) -> np.ndarray:
    """``block_ids[local]``; ValueError naming the shard's last block when the table is short."""
    if int(local[-1]) >= len(block_ids):
        raise ValueError(f"shard needs logical block {last}, {whose} {len(block_ids)} blocks")
    return np.asarray(block_ids, dtype=np.int64)[local]


def _limits(infos: list[tuple[PoolInfo, PoolInfo]]) -> tuple[int, int]:
    """(the smallest source pool's first dimension, the smallest destination pool's)."""
    if not infos:
        return 0, 0
    return min(s.shape[0] for s, _ in infos), min(d.shape[0] for _, d in infos)


def _in_range(what: str, ids: np.ndarray, size: int, whose: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
        bad = int(ids[(ids < 0) | (ids >= size)][0])
        raise ValueError(f"{what} {bad} is outside {whose} pool of {size}")


def pull_pair(cache: dict, layout, src: ModelCaches, dst: ModelCaches, dst_heads: int) -> PullPair:  # noqa: ANN001
    """The PullPair of (`src`, `dst`), kept in `cache` (at most MAX_PAIRS; rebuilt when a pool
    was replaced)."""
    key = (id(src), id(dst), dst_heads)
    pair = cache.get(key)
    if (pair is None or pair.src_caches is not src or pair.dst_caches is not dst or not pair.is_current()
            or pair.layout != layout):
        pair = PullPair(layout, src, dst, dst_heads)
        if len(cache) >= MAX_PAIRS:
            cache.pop(next(iter(cache)))
        cache[key] = pair
    return pair


class Pull:
    """One launched copy of a shard (engine thread), on `device`'s current stream: after the
    compute work queued before it (the destination blocks may have been read by the previous
    owner's last step), and without a stream switch or a cross-stream wait of its own. Pools in
    host memory (never exported by a ctx: in-process tests) are copied before this returns."""

    def __init__(self, pair: PullPair, groups: Sequence[UnitGroup], device: torch.device) -> None:
        self.pair = pair  # (its tensors and graphs stay alive while the copy may run)
        self.event: torch.cuda.Event | None = None  # (None: the copy ended already)
        if device.type != "cuda":
            pair.copier.copy(groups)
        elif device.index is not None and torch.cuda.current_device() != device.index:
            with torch.cuda.device(device):
                self._launch(groups)
        else:
            self._launch(groups)

    def _launch(self, groups: Sequence[UnitGroup]) -> None:
        stream = torch.cuda.current_stream()
        self.pair.copier.copy(groups, stream)
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def is_done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout_s: float) -> bool:
        """Wait (bounded) for the copy to end; False if it did not within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while not self.is_done():
            if time.monotonic() >= end:
                return False
            time.sleep(WAIT_TICK_S)
        return True


def warm_up_copy(device: torch.device) -> None:
    """Tiny pull-shaped copies on `device`, launched directly and through captured graphs (compiles
    the unit copy kernel for one, two and three groups at 16-byte vectors, and pays a process's
    first graph capture and pinned tables before any request); synchronizes."""
    src = torch.arange(4096, dtype=torch.int64, device=device).view(torch.uint8)
    dst = torch.zeros_like(src)
    units = np.asarray([[0, 0], [1536, 1536]], dtype=np.int64)  # the groups' units tile bytes [0, 3072)
    groups = [UnitGroup(512, np.zeros((1, 2), dtype=np.int64), units + 512 * g) for g in range(3)]
    with torch.cuda.device(device):
        for n in (1, 2, 3):
            unit_copy([src], [dst], groups[:n])
        torch.cuda.synchronize(device)
        direct = torch.equal(src[:3072], dst[:3072]) and not dst[3072:].any()
        dst.zero_()
        copier = UnitCopier([src], [dst], [g.segments for g in groups], graphs=True)
        copier.copy(groups)
        torch.cuda.synchronize(device)
    if not direct or not torch.equal(src[:3072], dst[:3072]) or dst[3072:].any():
        raise RuntimeError(f"the unit copy kernel is wrong on {device}")
