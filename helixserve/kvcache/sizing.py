"""Cache pool byte arithmetic (torch-free): what one MLA block and one KDA state slot cost, and
how many of each a byte budget holds. :mod:`helixserve.kvcache.pools` (the tensors),
:func:`helixserve.engine.rank_setup.size_cache` (the servers) and ``helixserve plan``
(:mod:`helixserve.planning`) all size their pools here.

Per rank, with ``L_mla`` MLA and ``L_kda`` KDA layers and ``b`` bytes per model-dtype value:

- one block:  ``L_mla * tokens_per_block * (kv_lora_rank + qk_rope_head_dim) * b``
- one slot:   ``L_kda * (H_local * K * V * 4 + 3 * H_local * K * (W - 1) * b)`` (fp32 recurrent
  state, then the short-conv windows in the model dtype)
"""

from __future__ import annotations

from helixserve.dtypes import ITEMSIZE

FP32_BYTES = ITEMSIZE["float32"]


def mla_block_bytes(num_mla_layers: int, tokens_per_block: int, entry_dim: int, itemsize: int) -> int:
    """Bytes one physical block costs over all MLA layers of a rank."""
    return num_mla_layers * tokens_per_block * entry_dim * itemsize


def kda_slot_bytes(num_kda_layers: int, num_local_heads: int, head_dim: int, conv_kernel_size: int,
                   itemsize: int) -> int:
    """Bytes one state slot costs over all KDA layers of a rank (fp32 state + conv windows)."""
    state = num_local_heads * head_dim * head_dim * FP32_BYTES
    conv = 3 * num_local_heads * head_dim * (conv_kernel_size - 1) * itemsize
    return num_kda_layers * (state + conv)


def pools_from_budget(block_bytes: int, slot_bytes: int, budget_bytes: int, max_num_seqs: int,
                      num_checkpoint_slots: int = 0) -> tuple[int, int]:
    """``(num_blocks, num_slots)`` for a memory budget: ``max_num_seqs`` slots and
    ``num_checkpoint_slots`` KDA state checkpoints (a slot's size each), the rest blocks.

    Raises ``ValueError`` when the budget cannot hold the slots plus one block per sequence.
    A model without MLA layers (``block_bytes == 0``) gets ``num_blocks = 0``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if num_checkpoint_slots < 0:
        raise ValueError(f"num_checkpoint_slots must be >= 0, got {num_checkpoint_slots}")
    all_slot_bytes = slot_bytes * (max_num_seqs + num_checkpoint_slots)
    left = budget_bytes - all_slot_bytes
    num_blocks = left // block_bytes if block_bytes else 0
    min_blocks = max_num_seqs if block_bytes else 0
    if left < 0 or num_blocks < min_blocks:
        raise ValueError(
            f"cache budget {budget_bytes} B too small: {max_num_seqs} slots and {num_checkpoint_slots} state "
            f"checkpoints take {all_slot_bytes} B ({slot_bytes} B each) and {max_num_seqs} blocks (one per sequence) need "
            f"{min_blocks * block_bytes} B more ({block_bytes} B each)"
        )
    return num_blocks, max_num_seqs
