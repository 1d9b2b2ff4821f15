"""Per-step forward metadata and the cache tensors a model reads and writes.

The runner builds one :class:`ForwardBatch` per step; the model never sees requests or queues.
A batch is a set of sequences, each contributing ``seq_len`` new tokens (prefill chunk or one
decode token), laid out flat (``[T]`` rows, ``cu_seqlens`` marking the boundaries).

Cache layout (owned by ``helixserve.kvcache``, passed in as :class:`ModelCaches`):

- MLA latent pool per MLA layer: ``[num_blocks, tokens_per_block, kv_lora_rank + qk_rope_head_dim]``
  in the model dtype. ``block_tables[i, b]`` is the physical block that holds *global logical*
  block ``b`` of sequence ``i``, or ``-1`` when that block is not held on this rank (helix CP
  shards blocks round-robin; on a single process every used entry is ``>= 0``).
- KDA recurrent state per KDA layer: ``[num_slots, H_local, K, V]`` float32 ([K, V] layout).
- KDA conv state per KDA layer: ``[num_slots, 3 * H_local * K, W - 1]`` (sections ``[q | k | v]``),
  the last ``W - 1`` inputs of the short convolutions, in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ForwardBatch:
    """Flat metadata for one forward step.

    Attributes:
        input_ids: ``[T]`` int64, new tokens of every sequence concatenated.
        positions: ``[T]`` int64, absolute position of each new token in its sequence.
        cu_seqlens: ``[B + 1]`` int64, row boundaries of the sequences in ``input_ids``.
        context_lens: ``[B]`` int64, tokens already in the caches before this step.
        block_tables: ``[B, max_blocks]`` int32, global logical block -> physical block, ``-1``
            when absent on this rank.
        state_slots: ``[B]`` int64, KDA state slot of each sequence.
        logits_indices: rows whose logits are wanted (``None`` = every row; empty = no row, the
            model skips its LM head and returns ``[0, vocab]``).
        is_decode: host-side hint that every sequence adds one token on top of cached context
            (``None`` = derive it from the tensors, a device sync; CUDA-graph steps set it).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor | None = None
    is_decode: bool | None = None

    @property
    def wants_no_logits(self) -> bool:
        """No row is sampled this step (only prompt chunks that are not a prompt's last)."""
        return self.logits_indices is not None and self.logits_indices.numel() == 0

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def kv_lens(self) -> torch.Tensor:
        """Tokens of each sequence in the MLA cache once this step's tokens are written."""
        return self.context_lens + self.seq_lens


@dataclass(slots=True)
class ModelCaches:
    """Cache tensors keyed by 0-based decoder layer index."""

    tokens_per_block: int
    mla_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_state: dict[int, torch.Tensor] = field(default_factory=dict)
    conv_state: dict[int, torch.Tensor] = field(default_factory=dict)
