"""Triton bodies of the MXFP4 expert GEMMs: gate_up with the SwiGLU epilogue, down with the
bias and routing weight, and the ordered top-k sum.

Rows of the GEMMs are (token, slot) pairs grouped by expert (see _moe_routing.py): program
(m, n) takes row block m of ``block_table`` and output columns [n·BLOCK_N, (n+1)·BLOCK_N). The
weight tiles are decoded in registers (_moe_dequant.py) and multiplied on the tensor cores.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl

from gptoss_serve.kernels._moe_common import _dot, _num_valid, _to_bf16
from gptoss_serve.kernels._moe_dequant import _dequant_tile


@triton.jit
def _mxfp4_matmul(
    a_row_ptrs, a_row_mask, blocks_ptr, scales_ptr, cols, col_mask,
    stride_block_row, stride_scale_row,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    PTX: tl.constexpr, INTERPRET: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """acc [BLOCK_M, BN] fp32 = A[rows, :K] @ W[cols, :K]^T; ``a_row_ptrs`` [BLOCK_M] point at
    the start of each bf16 activation row (gathered rows are fine).

    SWAP_AB computes acc^T = W @ A^T: the decoded weights become the left operand, which
    Hopper's wgmma reads from registers (no trip through shared memory; SASS shows
    HGMMA with register A and vector stores instead of one 16-bit store per element)."""
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    if SWAP_AB:
        acc = tl.zeros([cols.shape[0], BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, cols.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_mask = a_row_mask[:, None]
        if not EVEN_K:
            a_mask = a_mask & (ks < K)[None, :]
        a = tl.load(a_row_ptrs[:, None] + ks[None, :], mask=a_mask, other=0.0)
        w = _dequant_tile(
            blocks_ptr, scales_ptr, cols, col_mask, k0, K, stride_block_row, stride_scale_row,
            BLOCK_K, EVEN_K, PTX, LB,
        )  # fmt: skip
        if SWAP_AB:
            acc = _dot(w, tl.trans(a), acc, INTERPRET)
        else:
            acc = _dot(a, tl.trans(w), acc, INTERPRET)
    if SWAP_AB:
        acc = tl.trans(acc)  # one return: Triton checks every return's type, taken or not
    return acc


@triton.jit
def _row_block(
    block_table_ptr, num_blocks_ptr, max_blocks, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """This program's (live, expert, rows [BLOCK_M], row_mask, cols [BLOCK_N], col_mask).
    The grid is max_blocks x cdiv(N, BLOCK_N) with the column index fastest, so neighbouring
    programs share an expert and its activation rows."""
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    block = tl.program_id(0) // num_col_blocks
    cols = (tl.program_id(0) % num_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = block < tl.load(num_blocks_ptr)
    expert = tl.load(block_table_ptr + block)
    row_start = tl.load(block_table_ptr + max_blocks + block)
    row_end = tl.load(block_table_ptr + 2 * max_blocks + block)
    rows = row_start + tl.arange(0, BLOCK_M)
    return live, expert.to(tl.int64), rows, rows < row_end, cols, cols < N


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["max_blocks"])
def _gate_up_kernel(
    x_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    sorted_ids_ptr, block_table_ptr, num_blocks_ptr,
    N, max_blocks, top_k, alpha, limit,
    stride_x, stride_block_expert, stride_block_row, stride_scale_expert, stride_scale_row,
    stride_h,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, PTX: tl.constexpr, INTERPRET: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """h[row, j] = SwiGLU(x[token(row)] @ W_gate_up[e]^T + b)[j], bf16 [P, N/2].

    N = 2I interleaved (row 2j gate j, row 2j+1 up j): a BLOCK_N tile holds the gate and up
    columns of BLOCK_N/2 whole units, so the epilogue pairs them in registers.
    """
    live, expert, rows, row_mask, cols, col_mask = _row_block(
        block_table_ptr, num_blocks_ptr, max_blocks, N, BLOCK_M, BLOCK_N
    )
    if not live:
        return
    tokens = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0) // top_k
    acc = _mxfp4_matmul(
        x_ptr + tokens * stride_x, row_mask,
        blocks_ptr + expert * stride_block_expert, scales_ptr + expert * stride_scale_expert,
        cols, col_mask, stride_block_row, stride_scale_row, K, BLOCK_M, BLOCK_K, SWAP_AB, PTX,
        INTERPRET, LB,
    )  # fmt: skip
    bias = tl.load(bias_ptr + expert * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc + bias[None, :], [BLOCK_M, BLOCK_N // 2, 2]))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    col_block = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
    units = col_block * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # output columns of h
    mask = row_mask[:, None] & (units < N // 2)[None, :]
    h = _to_bf16(h, INTERPRET)
    tl.store(h_ptr + rows[:, None] * stride_h + units[None, :], h, mask=mask)


@triton.jit(do_not_specialize=["max_blocks"])
def _down_kernel(
    h_ptr, blocks_ptr, scales_ptr, bias_ptr, routing_weights_ptr, y_ptr,
    sorted_ids_ptr, block_table_ptr, num_blocks_ptr,
    N, max_blocks,
    stride_h, stride_block_expert, stride_block_row, stride_scale_expert, stride_scale_row,
    stride_y,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, PTX: tl.constexpr, INTERPRET: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """y[pair(row)] = w_pair · (h[row] @ W_down[e]^T + b), fp32 [P, H] in pair order."""
    live, expert, rows, row_mask, cols, col_mask = _row_block(
        block_table_ptr, num_blocks_ptr, max_blocks, N, BLOCK_M, BLOCK_N
    )
    if not live:
        return
    acc = _mxfp4_matmul(
        h_ptr + rows * stride_h, row_mask,
        blocks_ptr + expert * stride_block_expert, scales_ptr + expert * stride_scale_expert,
        cols, col_mask, stride_block_row, stride_scale_row, K, BLOCK_M, BLOCK_K, SWAP_AB, PTX,
        INTERPRET, LB,
    )  # fmt: skip
    bias = tl.load(bias_ptr + expert * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    pairs = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0)
    weight = tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0)
    y = (acc + bias[None, :]) * weight[:, None]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(y_ptr + pairs[:, None] * stride_y + cols[None, :], y, mask=mask)


@triton.jit
def _sum_pairs_kernel(
    y_ptr, out_ptr, N, stride_y, stride_out, valid_rows_ptr,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[t] = Σ_slot y[t·TOP_K + slot] in slot order (deterministic), bf16 [T, H]; zeros
    for the tokens at or past ``valid_rows[0]`` (None: none), whose y rows are never written."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    live = mask & (token < _num_valid(valid_rows_ptr, tl.num_programs(0)))
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (token * TOP_K + slot) * stride_y + cols, mask=live, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, _to_bf16(acc, INTERPRET), mask=mask)
