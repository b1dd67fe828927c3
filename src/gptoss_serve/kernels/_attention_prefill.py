"""Paged prefill attention (flash attention over a ragged batch, on top of a cache).

One program per (query block, KV head). A query block is BLOCK_Q consecutive new tokens of
one sequence times the GROUP query heads of the KV head, packed as BLOCK_M = BLOCK_Q ·
GROUP_PAD rows (row r = token r // GROUP_PAD, head r % GROUP_PAD), so every K/V tile feeds
all heads of the group. Query blocks are numbered per sequence from
``query_start_loc[s] // BLOCK_Q + s`` (vLLM's trick): an upper bound that needs no host
sync, so the grid is T // BLOCK_Q + S and surplus programs exit at once.

Keys: tiles that every row of the block sees in full run without masks; the diagonal tiles
(and, on sliding layers, the only ~BLOCK_Q + window keys a block needs) run masked. Loads
never touch keys outside [first key any row needs, last query + 1).
"""

# Triton convention: compile-time constants are UPPER_CASE parameters, and kernels (and
# the launchers that mirror them) take their tensors and strides positionally.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gptoss_serve.kernels._attention_common import (
    LOG2E,
    LOG2E_FLOAT,
    key_row_offsets,
    load_rows,
    softmax_update,
)
from gptoss_serve.kernels.fast_launch import launcher


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # packed (token, head) rows per program
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int


# Full layers, head_dim 64: 64 rows (8 tokens x 8 heads) x 64 keys on 4 warps (one warpgroup),
# 2 stages. It was 128 x 64 on 8 warps, 3 stages (Triton's fused-attention tutorial tiles for
# Hopper); alternating A/B on an H100 (bench/RESULTS.md v21), one 120b layer, a 1024 / 2048
# / 8192-token prompt: 47.6-48.3 / 135.0-137.0 / 1,565-1,603 -> 45.1-45.8 / 122.5-125.0 /
# 1,435-1,482 us, the same bits (each row's keys in the same order). The H200 sweep's own
# figures (results/attention_prefill_sweep.json) had it ahead too: 120.9 / 1,504.5 against
# 129.9 / 1,574.6 us at 2048 / 8192 tokens.
GPU_TILES = PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=2)
# Sliding layers: a query block needs only its BLOCK_Q + window - 1 keys, all in masked tiles,
# so a program is a few tiles long and small ones win: 8 tokens x 8 heads against 32 keys,
# 4 warps, 2 stages. H200, one 120b layer (bench/attention_prefill_sweep.py): a 2048 / 8192-
# token prompt 62.2 / 236.1 -> 35.5 / 120.3 us (the full layers' tiles of then: 131 / 1,571).
SLIDING_GPU_TILES = PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=2)
# Interpreter: small tiles so short test sequences cross several query and key tiles.
CPU_TILES = PrefillTiles(block_m=32, block_n=16, num_warps=1, num_stages=1)


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, block_id, BLOCK_Q: tl.constexpr):
    """The sequence s whose query blocks start at or before block_id (binary search)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= block_id:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_ptr, v_ptr, table_row, tile_start, key_end, q_pos, window, qk_scale,
    stride_cb, stride_ct, dims, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Fold keys [tile_start, tile_start + BLOCK_N) into the running softmax of [M] rows."""
    keys = tile_start + tl.arange(0, BLOCK_N)
    key_mask = None
    if MASKED:
        key_mask = keys < key_end
    offsets = key_row_offsets(table_row, keys, key_mask, stride_cb, stride_ct, PAGE_SIZE)
    k = load_rows(k_ptr, offsets, dims, key_mask)  # [N, D]
    scores = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N]
    if MASKED:
        visible = key_mask[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= (q_pos[:, None] - keys[None, :]) < window
        scores = tl.where(visible, scores, float("-inf"))
    v = load_rows(v_ptr, offsets, dims, key_mask)  # [N, D]
    return softmax_update(scores, v, m_i, l_i, acc)


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, query_start_ptr, seq_lens_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ot, stride_oh,
    num_seqs, window, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    # Highest block ids first: with causal masking they have the most keys (shorter tail).
    block_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_ptr, num_seqs, block_id, BLOCK_Q)
    query_start = tl.load(query_start_ptr + seq)
    num_new = tl.load(query_start_ptr + seq + 1) - query_start
    first_token = (block_id - (query_start // BLOCK_Q + seq)) * BLOCK_Q  # among the new ones
    if first_token >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP_PAD  # [M] index among this sequence's new tokens
    group_rows = rows % GROUP_PAD
    row_mask = (tokens < num_new) & (group_rows < GROUP)
    heads = kv_head * GROUP + group_rows
    q_pos = seq_len - num_new + tokens  # absolute positions
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = (query_start + tokens) * stride_qt + heads * stride_qh
    q = load_rows(q_ptr, q_offsets, dims, row_mask)  # [M, D]
    sinks = tl.load(sinks_ptr + heads, mask=group_rows < GROUP, other=0.0)
    m_i = sinks.to(tl.float32) * LOG2E  # the sink joins the softmax as one more logit
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    first_pos = seq_len - num_new + first_token
    key_end = seq_len - num_new + tl.minimum(first_token + BLOCK_Q, num_new)  # last query + 1
    if HAS_WINDOW:
        key_start = tl.maximum(first_pos - window + 1, 0)
        full_end = key_start  # ~BLOCK_Q + window keys: all masked
    else:
        key_start = 0
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every row sees in full
    table_row = table_ptr + seq * stride_tb
    k_head = k_ptr + kv_head * stride_ch
    v_head = v_ptr + kv_head * stride_ch
    for tile_start in range(key_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_head, v_head, table_row, tile_start, key_end, q_pos, window,
            qk_scale, stride_cb, stride_ct, dims, PAGE_SIZE, BLOCK_N, False, HAS_WINDOW,
        )  # fmt: skip
    for tile_start in range(full_end, key_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_head, v_head, table_row, tile_start, key_end, q_pos, window,
            qk_scale, stride_cb, stride_ct, dims, PAGE_SIZE, BLOCK_N, True, HAS_WINDOW,
        )  # fmt: skip

    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + (query_start + tokens) * stride_ot + heads * stride_oh
    tl.store(out_ptrs[:, None] + dims[None, :], out, mask=row_mask[:, None])


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    out: torch.Tensor,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Shapes as in attention.paged_attention_prefill; ``out`` [T, A, D] is written."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tiles = (GPU_TILES if window is None else SLIDING_GPU_TILES) if q.is_cuda else CPU_TILES
    block_m = max(tiles.block_m, group_pad)
    block_q = block_m // group_pad
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    launcher(_prefill_kernel)[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sinks, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_seqs, window or 0, scale * LOG2E_FLOAT,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        HAS_WINDOW=window is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
