"""One step's attention inputs, built by the runner and passed down explicitly.

A step's rows are its decodes first (``num_decodes`` one-token queries, the decode kernel's
shape) and then the prefill chunks (ragged, the prefill kernel's shape). Per KV group (0 full
attention, 1 sliding window) the K/V slots of every row and the block tables of each part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    num_decodes: int  # rows [0, num_decodes) are decodes, the rest prefill chunks
    positions: torch.Tensor  # [T] int64, position of each row's token
    # Per group [T] int64: block * BLOCK_SIZE + offset where the row's K/V go (-1: padding).
    slot_mapping: tuple[torch.Tensor, ...]
    # Decodes: per group [num_decodes, width] int32 block tables; [num_decodes] int32 lengths
    # including this step's token (0 for CUDA-graph padding rows).
    decode_block_tables: tuple[torch.Tensor, ...]
    decode_seq_lens: torch.Tensor
    # Host bound on decode_seq_lens: sizes the split-K attention grid (kernels/attention.py).
    decode_max_seq_len: int
    # Prefill chunks: per group [num_prefills, width] int32 tables, [num_prefills] int32
    # lengths, and [num_prefills + 1] int32 row offsets (relative to the first prefill row).
    prefill_block_tables: tuple[torch.Tensor, ...]
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
