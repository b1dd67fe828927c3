"""Triton kernels of the decode-path MoE with the (token, slot) pairs grouped by expert.

_moe_decode.py's GEMVs run one program per pair and row tile: a pair decodes its expert's
rows even when other pairs of the batch chose the same expert, and the n8 MMA carries one or
two useful activation columns. From ~32 tokens on the pairs share experts (64 tokens: 256 pairs
over ~111 experts; 256 tokens: ~8 pairs on each of the 128), so here a program takes (row
tile, group), a group being one expert and up to COLS (8 or 16) of its pairs, whose
activations fill one or two n8 MMAs' columns: each expert's rows are decoded once per COLS
pairs (bench/RESULTS.md v5: the experiment that measured the idea first).

1. ``_group_kernel`` (one program): the routing's pairs sorted by expert (stable) and cut into
   groups of up to COLS: ``group_expert`` [G_MAX] (-1 past the last group) and
   ``group_pairs`` [G_MAX, COLS] (-1 in unused columns). G_MAX bounds the groups of any
   routing, so the grid is fixed (CUDA graphs); programs of unused groups return at once. No
   atomics: deterministic.
2. ``_columns_gate_up_kernel``: h[pair] (thread order, bf16) for the BN rows of the group's
   expert, bias and clamped SwiGLU in the epilogue, one column per pair.
3. ``_columns_down_kernel``: y[pair] fp32 = w_pair · (h_pair @ Wd[expert]^T + bd) for BN rows;
   _moe_gemm._sum_pairs_kernel then adds each token's k pairs in slot order.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_common import _to_bf16
from gptoss_serve.kernels._moe_gemv import ACC_SCALE, _mxfp4_gemv, _tile_slots

GROUP_SIZES = (8, 16)  # pairs per group: one n8 MMA's columns, or two


def max_groups(num_pairs: int, num_experts: int, group_size: int = 8) -> int:
    """An upper bound of the groups of any routing of ``num_pairs`` pairs: Σ ceil(c_e / size)
    over the experts used is at most pairs / size + (one partial group per expert used)."""
    return min(num_pairs, num_pairs // group_size + min(num_experts, num_pairs))


@triton.jit
def _group_kernel(
    expert_ids_ptr, group_expert_ptr, group_pairs_ptr, num_pairs,
    G_MAX: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    E_PAD: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Pairs in chunks of CHUNK (any count): pass 1 counts each expert's pairs, pass 2 ranks
    each pair among the earlier pairs of its expert (within its chunk by a [CHUNK x CHUNK]
    comparison, plus the expert's pairs of earlier chunks) and scatters it."""
    if PDL:  # the routing comes from the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    fill = tl.arange(0, FILL)
    tl.store(group_pairs_ptr + fill, -1, mask=fill < G_MAX * COLS)
    tl.store(group_expert_ptr + fill, -1, mask=fill < G_MAX)
    tl.debug_barrier()  # the fill lands before the scatter below (same addresses)
    expert_range = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for chunk in tl.range(0, NUM_CHUNKS):
        pairs = chunk * CHUNK + tl.arange(0, CHUNK)
        experts = tl.load(expert_ids_ptr + pairs, mask=pairs < num_pairs, other=E_PAD)
        counts += tl.sum((expert_range[:, None] == experts[None, :]).to(tl.int32), axis=1)
    # Groups of each expert (ceil(count / COLS)), and where they start (experts in id order).
    num_groups = (counts + COLS - 1) // COLS
    first_group = tl.cumsum(num_groups, 0) - num_groups
    seen = tl.zeros([E_PAD], tl.int32)  # each expert's pairs in the chunks done
    for chunk in tl.range(0, NUM_CHUNKS):
        pairs = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = pairs < num_pairs
        experts = tl.load(expert_ids_ptr + pairs, mask=valid, other=E_PAD)  # padding: none
        chosen = expert_range[:, None] == experts[None, :]  # [E_PAD, CHUNK]
        same = (experts[:, None] == experts[None, :]) & (pairs[None, :] < pairs[:, None])
        rank = tl.sum(same.to(tl.int32), axis=1)
        rank += tl.sum(tl.where(chosen, seen[:, None], 0), axis=0)
        group = tl.sum(tl.where(chosen, first_group[:, None], 0), axis=0) + rank // COLS
        column = rank % COLS
        tl.store(group_pairs_ptr + group * COLS + column, pairs, mask=valid)
        tl.store(group_expert_ptr + group, experts, mask=valid & (column == 0))
        seen += tl.sum(chosen.to(tl.int32), axis=1)


@triton.jit
def _group_columns(group_expert_ptr, group_pairs_ptr, group, TOP_K: tl.constexpr,
                   COLS: tl.constexpr):  # fmt: skip
    """(expert int64 (-1: unused group), pairs [COLS] (-1: unused), valid, tokens)."""
    expert = tl.load(group_expert_ptr + group).to(tl.int64)
    pairs = tl.load(group_pairs_ptr + group * COLS + tl.arange(0, COLS))
    valid = pairs >= 0
    return expert, pairs, valid, tl.where(valid, pairs // TOP_K, 0)


@triton.jit
def _expert_rows(blocks_ptr, scales_ptr, expert, n0, N: tl.constexpr, K: tl.constexpr,
                 BN: tl.constexpr):  # fmt: skip
    """The GEMV slots of rows [n0, n0 + BN) of ``expert``'s [N, K] MXFP4 matrix, unsplit:
    (block pointers, scale pointers, valid groups per slot, group lane t)."""
    G: tl.constexpr = K // 32
    rows, t = _tile_slots(BN)
    row = n0 + rows
    row_groups = tl.where(row < N, G, 0)
    row = tl.minimum(row, N - 1)  # rows past the end read row N - 1 (unmasked main loop)
    block_rows = blocks_ptr + expert * (N * K // 2) + row * (K // 2) + 16 * t
    scale_rows = scales_ptr + expert * (N * G) + row * G + t
    return block_rows, scale_rows, row_groups, t


@triton.jit
def _columns_gate_up_kernel(
    x_thread_ptr, group_expert_ptr, group_pairs_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    alpha, limit,
    H: tl.constexpr, N: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    COLS: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """h[pair, units of rows n0 .. n0 + BN) for the group's pairs (rows interleaved gate/up)."""
    G: tl.constexpr = H // 32
    n0 = tl.program_id(0) * BN  # row tiles fastest: one expert's tiles run together
    if PDL:
        gdc_wait()  # x_thread (router) and the groups
    expert, pairs, valid, tokens = _group_columns(
        group_expert_ptr, group_pairs_ptr, tl.program_id(1), TOP_K, COLS
    )
    if expert < 0:
        return
    block_rows, scale_rows, row_groups, t = _expert_rows(
        blocks_ptr, scales_ptr, expert, n0, N, H, BN
    )
    acc = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, x_thread_ptr + tokens * H,
        tl.where(valid, G, 0), BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
    )  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    y = acc * ACC_SCALE + bias.to(tl.float32)[:, None]  # [BN, COLS]: column c is pair c
    gate, up = tl.split(tl.permute(tl.reshape(y, [BN // 2, 2, COLS]), (0, 2, 1)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = _to_bf16(gate * tl.sigmoid(alpha * gate) * (up + 1.0), INTERPRET)  # [BN/2, COLS]
    units = n0 // 2 + tl.arange(0, BN // 2)  # units j, stored at their thread-order position
    position = (units & ~7) | ((units & 1) << 2) | (units & 2) | ((units >> 2) & 1)
    ptrs = h_ptr + pairs.to(tl.int64)[None, :] * (N // 2) + position[:, None]
    tl.store(ptrs, h, mask=(units < N // 2)[:, None] & valid[None, :])


@triton.jit
def _columns_down_kernel(
    h_ptr, group_expert_ptr, group_pairs_ptr, routing_weights_ptr, blocks_ptr, scales_ptr,
    bias_ptr, y_ptr, stride_y,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    COLS: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """y[pair, n0 : n0 + BN] fp32 = w_pair · (h_pair @ Wd[expert][rows]^T + bd[rows])."""
    G: tl.constexpr = K // 32
    n0 = tl.program_id(0) * BN
    if PDL:
        gdc_wait()  # h
    expert, pairs, valid, _ = _group_columns(
        group_expert_ptr, group_pairs_ptr, tl.program_id(1), TOP_K, COLS
    )
    if expert < 0:
        return
    block_rows, scale_rows, row_groups, t = _expert_rows(
        blocks_ptr, scales_ptr, expert, n0, N, K, BN
    )
    col_ptrs = h_ptr + tl.where(valid, pairs, 0).to(tl.int64) * K
    acc = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, col_ptrs, tl.where(valid, G, 0),
        BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
    )  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    weights = tl.load(routing_weights_ptr + pairs, mask=valid, other=0.0)
    y = (acc * ACC_SCALE + bias.to(tl.float32)[:, None]) * weights[None, :]
    ptrs = y_ptr + pairs.to(tl.int64)[None, :] * stride_y + out_rows[:, None]
    tl.store(ptrs, y, mask=(out_rows < N)[:, None] & valid[None, :])
