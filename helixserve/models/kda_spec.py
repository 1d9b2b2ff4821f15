"""KDA under speculative decoding: a verify step row by row, and the rollback of a rejection.

A verify step runs each speculating sequence's last token and its ``n`` drafts. When every
sequence of the step continues a cached context (decodes and verify rows, no prompt chunk) the
step runs *row by row* (:func:`advance`): row ``j`` of every sequence that has one goes through
the decode kernels (``short_conv_step`` then ``kda_recurrent_step``) together, so a sequence
without drafts is advanced exactly as a plain decode step advances it, and ``n + 1`` rows cost
``n + 1`` decode steps instead of a chunked prefill padded to its chunk size. A step that also
carries prompt chunks runs the chunked (prefill) path for all of its sequences.

Either way the slot's recurrent and conv state end advanced past all ``n + 1`` rows. When the
target accepts ``a < n`` drafts only the first ``a + 1`` rows belong to the sequence. Rollback by
*recompute*: during the forward each KDA layer saves, for the verify rows only, its conv inputs
(``qkv`` before the short conv), the gate ``g`` and ``beta``, and the slot's conv and recurrent
state before the step (:meth:`KdaRecord.save`); after acceptance :func:`replay` restores the
saved state and runs :func:`advance` over the kept rows, exactly as plain decoding would have
advanced the slot from the same projected inputs. The conv state after the replay is the last
``W - 1`` inputs ending at the last kept row.

Cost per speculating sequence and KDA layer: ``(n + 1) * (3 H K + H K + H)`` saved values, one
state ``H K V`` fp32 and one conv state; the alternative, keeping the per-position states of the
verify step, costs ``(n + 1) * H K V * 4`` bytes per layer (``bench/spec_decode.py`` prints both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helixserve import kernels


@dataclass(slots=True)
class KdaSaved:
    """One KDA layer's saved inputs of the verify rows and its slots' state before the step."""

    qkv: torch.Tensor  # [R, 3HK] conv inputs
    g: torch.Tensor  # [R, H, K]
    beta: torch.Tensor  # [R, H]
    conv_state: torch.Tensor  # [Bv, 3HK, W-1]
    kda_state: torch.Tensor  # [Bv, H, K, V] fp32


@dataclass(slots=True)
class KdaRecord:
    """What a verify step's KDA layers save (see the module docstring).

    Attributes:
        seq_index: ``[Bv]`` int64, the batch's speculating sequences (their index in the batch).
        rows: ``[R]`` int64, their rows in the flat batch, sequence after sequence.
        row_starts: host, each speculating sequence's first row within ``rows``.
        num_rows: host, each one's row count (``n + 1``).
        slots: ``[Bv]`` int64, their state slots.
        batch_seqs: host, ``seq_index``.
        steps: the step row by row (``None``: it carries prompt chunks, the chunked path runs):
            per row offset ``j``, the flat rows of every batch sequence with more than ``j``
            rows and those sequences' state slots.
    """

    seq_index: torch.Tensor
    rows: torch.Tensor
    row_starts: list[int]
    num_rows: list[int]
    slots: torch.Tensor
    batch_seqs: list[int]
    steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    layers: dict[int, KdaSaved] = field(default_factory=dict)

    def save(self, layer_idx: int, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             conv_state: torch.Tensor, kda_state: torch.Tensor, per_seq: bool = True) -> None:
        """Keep the verify rows of one layer's ``qkv``/``g``/``beta`` (all rows of the batch) and
        the speculating slots' rows of its pre-step states (``per_seq``: one row per batch
        sequence; else one per speculating sequence already)."""
        if per_seq:
            conv_state, kda_state = conv_state.index_select(0, self.seq_index), kda_state.index_select(0, self.seq_index)
        self.layers[layer_idx] = KdaSaved(
            qkv.index_select(0, self.rows), g.index_select(0, self.rows), beta.index_select(0, self.rows),
            conv_state, kda_state)


def advance(mixer: torch.nn.Module, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            conv_pool: torch.Tensor, state_pool: torch.Tensor,
            steps: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Advance slots row by row with the decode kernels of ``mixer`` (a
    :class:`~helixserve.models.kda.KimiDeltaAttention`): for each ``(rows, slots)`` of ``steps``,
    ``qkv``/``g``/``beta`` rows ``rows`` are one decode step of ``slots``. Returns the outputs
    ``[R, H, K]`` (``R = qkv.shape[0]``, rows no step names left unset; ``None``: no step)."""
    H, K = mixer.num_heads, mixer.head_dim
    weight = mixer.conv_weight()
    out: torch.Tensor | None = None
    for rows, slots in steps:
        x = kernels.short_conv_step(qkv.index_select(0, rows), weight, conv_pool, slots, activation="silu")
        q, k, v = x.reshape(rows.shape[0], 3, H, K).unbind(1)
        o = kernels.kda_recurrent_step(q, k, v, g.index_select(0, rows), beta.index_select(0, rows),
                                       state_pool, slots, scale=K**-0.5, use_qk_l2norm=True)
        if out is None:
            out = o.new_empty(qkv.shape[0], *o.shape[1:])
        out.index_copy_(0, rows, o)
    return out


def verify_rows(mixer: torch.nn.Module, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_pool: torch.Tensor, state_pool: torch.Tensor, record: KdaRecord) -> torch.Tensor:
    """A verify step of one KDA layer row by row (``record.steps``), its speculating slots'
    pre-step states saved for :func:`replay`; returns the outputs ``[T, H, K]``."""
    assert record.steps is not None
    record.save(mixer.layer_idx, qkv, g, beta, conv_pool.index_select(0, record.slots),
                state_pool.index_select(0, record.slots), per_seq=False)
    out = advance(mixer, qkv, g, beta, conv_pool, state_pool, record.steps)
    assert out is not None  # a verify step has rows
    return out


def replay(mixer: torch.nn.Module, saved: KdaSaved, conv_pool: torch.Tensor, state_pool: torch.Tensor,
           record: KdaRecord, keep: dict[int, int]) -> None:
    """Restore the slots of the speculating sequences ``keep`` names (index into the record's
    sequences -> rows to keep, fewer than its rows) and advance them over their kept rows with
    the decode kernels of ``mixer`` (a :class:`~helixserve.models.kda.KimiDeltaAttention`)."""
    device = saved.qkv.device
    which = sorted(keep)
    index = torch.tensor(which, dtype=torch.int64, device=device)
    slots = record.slots.index_select(0, index)
    conv_pool.index_copy_(0, slots, saved.conv_state.index_select(0, index))
    state_pool.index_copy_(0, slots, saved.kda_state.index_select(0, index).to(state_pool.dtype))
    steps = []
    for j in range(max(keep.values())):
        live = [(p, i) for p, i in enumerate(which) if keep[i] > j]
        pos = torch.tensor([p for p, _ in live], dtype=torch.int64, device=device)
        rows = torch.tensor([record.row_starts[i] + j for _, i in live], dtype=torch.int64, device=device)
        steps.append((rows, slots.index_select(0, pos)))
    advance(mixer, saved.qkv, saved.g, saved.beta, conv_pool, state_pool, steps)


def replay_all(mixer: torch.nn.Module, saved: KdaSaved, conv_pool: torch.Tensor, state_pool: torch.Tensor,
               restore_slots: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`replay` at fixed shapes (a captured graph's, no host reads): every sequence of the
    record is restored into ``restore_slots`` and advanced by ``steps`` (its rows, and the slot
    each sequence advances at that row), where a sequence that keeps all its rows, and every
    sequence past the rows it keeps, names a scratch slot no request owns."""
    conv_pool.index_copy_(0, restore_slots, saved.conv_state)
    state_pool.index_copy_(0, restore_slots, saved.kda_state.to(state_pool.dtype))
    advance(mixer, saved.qkv, saved.g, saved.beta, conv_pool, state_pool, steps)
