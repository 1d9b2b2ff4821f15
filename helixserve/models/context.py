"""Per-step forward metadata a model reads.

The runner builds one :class:`ForwardBatch` per step; the model never sees requests or queues.
A batch is a set of sequences, each contributing ``seq_len`` new tokens (prefill chunk or one
decode token), laid out flat (``[T]`` rows, ``cu_seqlens`` marking the boundaries).

The cache tensors come in as :class:`~helixserve.cache_layout.ModelCaches` (layouts there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helixserve.kernels._host import step_value

if TYPE_CHECKING:
    from helixserve.models.hidden_capture import HiddenCapture
    from helixserve.models.kda_checkpoints import StateSaves
    from helixserve.models.kda_spec import KdaRecord


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
        kda_record: a verify step's record of its speculating sequences' KDA inputs and
            pre-step states, for the rollback after acceptance (:mod:`.kda_spec`).
        state_saves: KDA state checkpoints taken inside the step's prefill chunks
            (:mod:`.kda_checkpoints`).
        hidden_capture: the decoder layers whose outputs the forward keeps for every row (a
            hidden-state drafter's features, :mod:`.hidden_capture`; ``None``: none kept).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor | None = None
    is_decode: bool | None = None
    kda_record: KdaRecord | None = None
    state_saves: StateSaves | None = None
    hidden_capture: HiddenCapture | None = None

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
        """Tokens of each sequence in the MLA cache once this step's tokens are written (computed
        once per step)."""
        return step_value(self.context_lens, "kv_lens", lambda: self.context_lens + self.seq_lens)
