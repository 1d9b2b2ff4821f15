"""KDA state under speculative decoding: roll a verify step's slots back to the last accepted token.

A verify step runs each speculating sequence's last token and its ``n`` drafts through the
chunked (prefill) path, which leaves the slot's recurrent and conv state advanced past all
``n + 1`` rows. When the target accepts ``a < n`` drafts only the first ``a + 1`` rows belong to
the sequence. Rollback by *recompute*: during the forward each KDA layer saves, for the verify
rows only, its conv inputs (``qkv`` before the short conv), the gate ``g`` and ``beta``, and the
slot's conv and recurrent state before the step (:meth:`KdaRecord.save`); after acceptance
:func:`replay` restores the saved state and runs the decode kernels (``short_conv_step`` then
``kda_recurrent_step``) over the kept rows, one row per sequence at a time, exactly as plain
decoding would have advanced the slot from the same projected inputs. The conv state after
the replay is the last ``W - 1`` inputs ending at the last kept row.

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
    """

    seq_index: torch.Tensor
    rows: torch.Tensor
    row_starts: list[int]
    num_rows: list[int]
    slots: torch.Tensor
    batch_seqs: list[int]
    layers: dict[int, KdaSaved] = field(default_factory=dict)

    def save(self, layer_idx: int, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             conv_state: torch.Tensor, kda_state: torch.Tensor) -> None:
        """Keep the verify rows of one layer's ``qkv``/``g``/``beta`` (all rows of the batch) and
        the speculating slots' rows of its pre-step states (one row per batch sequence)."""
        self.layers[layer_idx] = KdaSaved(
            qkv.index_select(0, self.rows), g.index_select(0, self.rows), beta.index_select(0, self.rows),
            conv_state.index_select(0, self.seq_index), kda_state.index_select(0, self.seq_index))


def replay(mixer: torch.nn.Module, saved: KdaSaved, conv_pool: torch.Tensor, state_pool: torch.Tensor,
           record: KdaRecord, keep: dict[int, int]) -> None:
    """Restore the slots of the speculating sequences ``keep`` names (index into the record's
    sequences -> rows to keep, fewer than its rows) and advance them over their kept rows with
    the decode kernels of ``mixer`` (a :class:`~helixserve.models.kda.KimiDeltaAttention`)."""
    H, K = mixer.num_heads, mixer.head_dim
    device = saved.qkv.device
    which = sorted(keep)
    index = torch.tensor(which, dtype=torch.int64, device=device)
    slots = record.slots.index_select(0, index)
    conv_pool.index_copy_(0, slots, saved.conv_state.index_select(0, index))
    state_pool.index_copy_(0, slots, saved.kda_state.index_select(0, index).to(state_pool.dtype))
    weight = mixer.conv_weight()
    for j in range(max(keep.values())):
        live = [(p, i) for p, i in enumerate(which) if keep[i] > j]
        pos = torch.tensor([p for p, _ in live], dtype=torch.int64, device=device)
        rows = torch.tensor([record.row_starts[i] + j for _, i in live], dtype=torch.int64, device=device)
        step_slots = slots.index_select(0, pos)
        qkv = kernels.short_conv_step(saved.qkv.index_select(0, rows), weight, conv_pool, step_slots,
                                      activation="silu")
        q, k, v = qkv.reshape(len(live), 3, H, K).unbind(1)
        kernels.kda_recurrent_step(q, k, v, saved.g.index_select(0, rows), saved.beta.index_select(0, rows),
                                   state_pool, step_slots, scale=K**-0.5, use_qk_l2norm=True)
