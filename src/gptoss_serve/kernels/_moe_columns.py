"""Triton kernels of the decode-path MoE with the (token, slot) pairs grouped by expert.

_moe_decode.py's GEMVs run one program per pair and row tile: a pair decodes its expert's
rows even when other pairs of the batch chose the same expert, and the n8 MMA carries one or
two useful activation columns. From ~32 tokens on the pairs share experts (64 tokens: 256 pairs
over ~111 experts; 256 tokens: ~8 pairs on each of the 128), so here a program takes (row
tile, group), a group being one expert and up to COLS (8 to 64) of its pairs, whose
activations fill the columns of COLS / 8 n8 MMAs: each expert's rows are decoded once per COLS
pairs (bench/RESULTS.md v5: the experiment that measured the idea first).

1. ``_group_kernel`` (one program): the routing's pairs sorted by expert (stable; a bitonic
   sort and three scans, so ~P log² P work rather than the P² of a rank matrix) and cut into
   groups of up to COLS: ``group_expert`` [G_MAX] (-1 past the last group) and
   ``group_pairs`` [G_MAX, COLS] (-1 in unused columns). G_MAX bounds the groups of any
   routing, so the grid is fixed (CUDA graphs); programs of unused groups return at once. No
   atomics: deterministic. The pairs of padding tokens (from ``valid_rows[0]`` on, a count
   read on the device) join no group, so the GEMVs below never see them. Past
   SORT_MAX_PAIRS pairs (prefill) one program is too slow, and the grouped GEMMs'
   multi-program grouping writes a block table that ``_table_groups_kernel`` turns into the
   same two arrays.
2. ``_columns_gate_up_kernel``: h[pair] (thread order, bf16) for the BN rows of the group's
   expert, bias and clamped SwiGLU in the epilogue, one column per pair.
3. ``_columns_down_kernel``: y[pair] fp32 = w_pair · (h_pair @ Wd[expert]^T + bd) for BN rows;
   _moe_gemm._sum_pairs_kernel then adds each token's k pairs in slot order.

With EXTRA (``DecodeTiles.next_group_columns``) the program of a group also takes the next
group when it is the same expert's last with at most EXTRA pairs (``_next_group_columns``):
a second dot on the same decoded tile, so an expert that overflows its first group by a few
pairs (half of them at 2048 tokens) is decoded once, not twice.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_common import _num_valid, _to_bf16
from gptoss_serve.kernels._moe_gemv import (
    _WGMMA,
    ACC_SCALE,
    _mxfp4_gemv,
    _scale_words,
    _slot_blocks,
    _stored_groups,
    _tile_slots,
)

GROUP_SIZES = (8, 16, 32, 64, 128, 256)  # pairs per group: one n8 MMA's columns, or more
# Past this many pairs the one-program sort gives way to the prefill grouping's count, block
# table and scatter (_moe_routing.py) and ``_table_groups_kernel``.
SORT_MAX_PAIRS = 4096


def max_groups(num_pairs: int, num_experts: int, group_size: int = 8) -> int:
    """An upper bound of the groups of any routing of ``num_pairs`` pairs: Σ ceil(c_e / size)
    over the experts used is at most pairs / size + (one partial group per expert used)."""
    return min(num_pairs, num_pairs // group_size + min(num_experts, num_pairs))


def groups_reference(
    expert_ids: torch.Tensor, num_experts: int, group_size: int, g_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_group_kernel`` writes, in torch: (group_expert [g_max], group_pairs [g_max,
    group_size]), -1 where unused; experts in id order, each expert's pairs in pair order."""
    flat = expert_ids.reshape(-1).long().cpu()
    group_expert = torch.full((g_max,), -1, dtype=torch.int32)
    group_pairs = torch.full((g_max, group_size), -1, dtype=torch.int32)
    group = 0
    for expert in range(num_experts):
        pairs = (flat == expert).nonzero().flatten()
        for start in range(0, len(pairs), group_size):
            chunk = pairs[start : start + group_size]
            group_expert[group] = expert
            group_pairs[group, : len(chunk)] = chunk.int()
            group += 1
    return group_expert, group_pairs


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_pairs", "g_max"])
def _group_kernel(
    expert_ids_ptr, group_expert_ptr, group_pairs_ptr, num_pairs, valid_rows_ptr, g_max,
    COLS: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
    PDL: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """One sort of the keys expert · P_PAD + pair (unique, so the order is stable: an expert's
    pairs in pair order), then scans: a pair's rank is its distance from its expert's first
    sorted position (a running max of the run starts), a group starts at every rank that is a
    multiple of COLS, and a running count of those numbers the groups. The pairs of tokens at
    or past ``valid_rows[0]`` (None: none) are padding, left out like the sort's own. ``g_max``
    (the tables' groups) is a runtime value: as a constexpr it compiled the kernel anew for
    every token count an eager step brought (seconds of a request's TTFT)."""
    # The count is the host's upload (before the graph), not the previous kernel's output.
    num_valid = _num_valid(valid_rows_ptr, num_pairs, TOP_K)
    if PDL:  # the routing comes from the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    _group_pairs(expert_ids_ptr, group_expert_ptr, group_pairs_ptr, num_valid, g_max, COLS,
                 P_PAD, E_PAD, FILL)  # fmt: skip


@triton.jit
def _group_pairs(
    expert_ids_ptr, group_expert_ptr, group_pairs_ptr, num_valid, g_max, COLS: tl.constexpr,
    P_PAD: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """``_group_kernel``'s work in one program, on the first ``num_valid`` pairs' expert ids:
    also the decode router's last program's, right after it wrote them (_moe_decode)."""
    f0 = tl.program_id(0) * 0  # a runtime bound: a while loop (the interpreter's range needs ints)
    while f0 < g_max * COLS:
        fill = f0 + tl.arange(0, FILL)
        tl.store(group_pairs_ptr + fill, -1, mask=fill < g_max * COLS)
        tl.store(group_expert_ptr + fill, -1, mask=fill < g_max)
        f0 += FILL
    tl.debug_barrier()  # the fill lands before the scatter below (same addresses)
    index = tl.arange(0, P_PAD)
    experts = tl.load(expert_ids_ptr + index, mask=index < num_valid, other=E_PAD)  # pad: last
    keys = tl.sort(experts * P_PAD + index)
    experts = keys // P_PAD
    pairs = keys % P_PAD
    before = tl.gather(experts, tl.maximum(index - 1, 0), 0)
    run_start = tl.where((index == 0) | (experts != before), index, 0)
    rank = index - tl.associative_scan(run_start, 0, _max)
    column = rank % COLS
    group = tl.cumsum((column == 0).to(tl.int32), 0) - 1
    valid = experts < E_PAD
    tl.store(group_pairs_ptr + group * COLS + column, pairs, mask=valid)
    tl.store(group_expert_ptr + group, experts, mask=valid & (column == 0))


@triton.jit(do_not_specialize=["g_max"])
def _table_groups_kernel(
    sorted_pairs_ptr, block_table_ptr, num_blocks_ptr, group_expert_ptr, group_pairs_ptr, g_max,
    COLS: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """The prefill grouping (``block_table`` [3, g_max]: expert, first and end row of
    ``sorted_pairs`` of each block of up to COLS pairs; ``num_blocks`` of them) rewritten as
    the columns' groups, every entry written (-1 where unused). Within a group the pairs come
    in the scatter's order, which changes no value: each pair is its own MMA column."""
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    in_table = groups < g_max
    live = in_table & (groups < tl.load(num_blocks_ptr))
    expert = tl.load(block_table_ptr + groups, mask=live, other=-1)
    start = tl.load(block_table_ptr + g_max + groups, mask=live, other=0)
    end = tl.load(block_table_ptr + 2 * g_max + groups, mask=live, other=0)
    rows = start[:, None] + tl.arange(0, COLS)[None, :]
    pairs = tl.load(sorted_pairs_ptr + rows, mask=rows < end[:, None], other=-1)
    tl.store(group_expert_ptr + groups, expert, mask=in_table)
    entries = groups[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(group_pairs_ptr + entries, pairs, mask=in_table[:, None])


@triton.jit
def _group_columns(group_expert_ptr, group_pairs_ptr, group, TOP_K: tl.constexpr,
                   COLS: tl.constexpr):  # fmt: skip
    """(expert int64 (-1: unused group), pairs [COLS] (-1: unused), valid, tokens)."""
    expert = tl.load(group_expert_ptr + group).to(tl.int64)
    pairs = tl.load(group_pairs_ptr + group * COLS + tl.arange(0, COLS))
    valid = pairs >= 0
    return expert, pairs, valid, tl.where(valid, pairs // TOP_K, 0)


@triton.jit
def _next_group_columns(group_expert_ptr, group_pairs_ptr, group, expert, TOP_K: tl.constexpr,
                        COLS: tl.constexpr, EXTRA: tl.constexpr):  # fmt: skip
    """An expert's groups are consecutive, their pairs packed and only its last group partial:
    the program of a group also multiplies the next group when that is the same expert's with
    at most EXTRA pairs (extra MMA columns, same decoded tiles), and the next group's own
    program then has nothing to do. (taken: this group is such a next group; used: this
    program takes one; pairs2 [EXTRA] of the next group or -1, valid2, tokens2.)"""
    before = tl.load(group_expert_ptr + group - 1, mask=group > 0, other=-1)
    taken = (before == expert) & (tl.load(group_pairs_ptr + group * COLS + EXTRA) < 0)
    has_next = group + 1 < tl.num_programs(1)
    following = tl.load(group_expert_ptr + group + 1, mask=has_next, other=-1)
    next_pairs = group_pairs_ptr + (group + 1) * COLS
    short = tl.load(next_pairs + EXTRA, mask=has_next, other=0) < 0
    used = has_next & (following == expert) & short  # (an expert's group is never empty)
    pairs2 = tl.load(next_pairs + tl.arange(0, EXTRA), mask=used, other=-1)
    valid2 = pairs2 >= 0
    return taken, used, pairs2, valid2, tl.where(valid2, pairs2 // TOP_K, 0)


@triton.jit
def _expert_rows(blocks_ptr, scales_ptr, expert, n0, N: tl.constexpr, K: tl.constexpr,
                 BN: tl.constexpr, SCALE_WORDS: tl.constexpr = False,
                 LB: tl.constexpr = 1):  # fmt: skip
    """The GEMV slots of rows [n0, n0 + BN) of ``expert``'s [N, K] MXFP4 matrix, unsplit:
    (block pointers, scale pointers, valid groups per slot, group lane t, scale shifts), the
    blocks and scales in bands of LB rows (_moe_gemv._slot_blocks). SCALE_WORDS: the scale
    pointers point at aligned words and the shifts pick the byte (_moe_gemv._scale_words);
    else the shifts are unused (t)."""
    G: tl.constexpr = K // 32
    GS: tl.constexpr = _stored_groups(G, LB)
    rows, t = _tile_slots(BN)
    row = n0 + rows
    row_groups = tl.where(row < N, G, 0)
    row = tl.minimum(row, N - 1)  # rows past the end read row N - 1 (unmasked main loop)
    block_rows = _slot_blocks(blocks_ptr + expert * (N * GS * 16), row, t, G, LB)
    scale_offsets = expert * (N * GS) + row * GS + t
    if SCALE_WORDS:
        scale_rows, shifts = _scale_words(scales_ptr, scale_offsets)
    else:
        scale_rows, shifts = scales_ptr + scale_offsets, t
    return block_rows, scale_rows, row_groups, t, shifts


@triton.jit
def _tile_position(j, ORDER: tl.constexpr):
    """Where element j of a row sits in tile order: in each step of 128, element 32t + e
    (e = 8q + 4h + 2m + p) is tile column 32q + 16m + 4t + 2p + h, or with ORDER_WGMMA
    32q + 16m + 8p + 2t + h (_moe_gemv.py)."""
    r = j % 128
    t, e = r // 32, r % 32
    q, h, m, p = e >> 3, (e >> 2) & 1, (e >> 1) & 1, e & 1
    if ORDER == _WGMMA:
        return (j - r) + 32 * q + 16 * m + 8 * p + 2 * t + h
    return (j - r) + 32 * q + 16 * m + 4 * t + 2 * p + h


@triton.jit
def _tile_order_step(x, ORDER: tl.constexpr):
    """[R, 128] (one step, natural order) -> the same values in tile order (_tile_position)."""
    x = tl.reshape(x, [x.shape[0], 4, 4, 2, 2, 2])  # t q h m p
    if ORDER == _WGMMA:
        return tl.reshape(tl.permute(x, (0, 2, 4, 5, 1, 3)), [x.shape[0], 128])  # q m p t h
    return tl.reshape(tl.permute(x, (0, 2, 4, 1, 5, 3)), [x.shape[0], 128])  # q m t p h


@triton.jit
def _zero_padding(h_ptr, pairs, valid, UNITS: tl.constexpr, ORDER: tl.constexpr,
                  H_STRIDE: tl.constexpr):  # fmt: skip
    """Zeros at the tile-order positions of units [UNITS, 128·ceil(UNITS / 128)) of the
    ``pairs``' h rows (H_STRIDE apart): the down GEMV reads whole steps without masks."""
    PAD: tl.constexpr = 128 * ((UNITS + 127) // 128) - UNITS
    if PAD > 0:
        PAD_POW2: tl.constexpr = triton.next_power_of_2(PAD)
        units = UNITS + tl.arange(0, PAD_POW2)
        ptrs = h_ptr + pairs.to(tl.int64)[None, :] * H_STRIDE
        ptrs = ptrs + _tile_position(units, ORDER)[:, None]
        zeros = tl.zeros([PAD_POW2, pairs.shape[0]], h_ptr.dtype.element_ty)
        tl.store(ptrs, zeros, mask=(units < UNITS + PAD)[:, None] & valid[None, :])


@triton.jit
def _columns_gate_up_kernel(
    x_thread_ptr, group_expert_ptr, group_pairs_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    alpha, limit,
    H: tl.constexpr, N: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    COLS: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr, INTERPRET: tl.constexpr, TILE_ORDER: tl.constexpr,
    X_STRIDE: tl.constexpr, H_STRIDE: tl.constexpr, SCALE_WORDS: tl.constexpr = False,
    EXTRA: tl.constexpr = 0, LB: tl.constexpr = 1,
):  # fmt: skip
    """h[pair, units of rows n0 .. n0 + BN) for the group's pairs (rows interleaved gate/up).
    x rows (X_STRIDE apart) and the h rows written (H_STRIDE apart) are in the order
    TILE_ORDER (_moe_gemv.ORDER_*: thread order, or a tile order). EXTRA (tile order): also
    the next group's pairs when it is this expert's last with at most EXTRA
    (``_next_group_columns``)."""
    G: tl.constexpr = H // 32
    n0 = tl.program_id(0) * BN  # row tiles fastest: one expert's tiles run together
    if PDL:
        gdc_wait()  # x_thread (router) and the groups
    expert, pairs, valid, tokens = _group_columns(
        group_expert_ptr, group_pairs_ptr, tl.program_id(1), TOP_K, COLS
    )
    if expert < 0:
        return
    if EXTRA > 0:
        taken, extra, pairs2, valid2, tokens2 = _next_group_columns(
            group_expert_ptr, group_pairs_ptr, tl.program_id(1), expert, TOP_K, COLS, EXTRA
        )
        if taken:  # the previous group's program multiplies this one's pairs
            return
    else:
        extra: tl.constexpr = False
    block_rows, scale_rows, row_groups, t, shifts = _expert_rows(
        blocks_ptr, scales_ptr, expert, n0, N, H, BN, SCALE_WORDS, LB
    )
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    if extra:  # the extra MMA only where it is used
        acc, acc2 = _mxfp4_gemv(
            block_rows, scale_rows, row_groups, t, x_thread_ptr + tokens * X_STRIDE,
            tl.where(valid, G, 0), BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
            TILE_ORDER, SCALE_WORDS, shifts, LB=LB,
            col_ptrs2=x_thread_ptr + tokens2 * X_STRIDE, col_groups2=tl.where(valid2, G, 0),
        )  # fmt: skip
        if PDL:
            gdc_launch_dependents()
        _store_h(acc2, pairs2, valid2, n0, bias, h_ptr, alpha, limit, N, BN, INTERPRET,
                 TILE_ORDER, H_STRIDE)  # fmt: skip
    else:
        acc, _no_extra = _mxfp4_gemv(
            block_rows, scale_rows, row_groups, t, x_thread_ptr + tokens * X_STRIDE,
            tl.where(valid, G, 0), BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
            TILE_ORDER, SCALE_WORDS, shifts, LB=LB,
        )  # fmt: skip
        if PDL:
            gdc_launch_dependents()
    _store_h(acc, pairs, valid, n0, bias, h_ptr, alpha, limit, N, BN, INTERPRET, TILE_ORDER,
             H_STRIDE)  # fmt: skip


@triton.jit
def _store_h(acc, pairs, valid, n0, bias, h_ptr, alpha, limit, N: tl.constexpr,
             BN: tl.constexpr, INTERPRET: tl.constexpr, TILE_ORDER: tl.constexpr,
             H_STRIDE: tl.constexpr):  # fmt: skip
    """gate_up's epilogue: bias and the clamped SwiGLU of acc [BN, NC] (column c: pair c),
    h stored at the units' down-GEMV positions of the valid pairs' rows."""
    NC: tl.constexpr = acc.shape[1]
    y = acc * ACC_SCALE + bias.to(tl.float32)[:, None]
    gate, up = tl.split(tl.permute(tl.reshape(y, [BN // 2, 2, NC]), (0, 2, 1)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = _to_bf16(gate * tl.sigmoid(alpha * gate) * (up + 1.0), INTERPRET)  # [BN/2, NC]
    units = n0 // 2 + tl.arange(0, BN // 2)  # units j, stored at their down-GEMV position
    if TILE_ORDER:
        if tl.program_id(0) == 0:  # the rows' padding to whole steps: zeros, read unmasked
            _zero_padding(h_ptr, pairs, valid, N // 2, TILE_ORDER, H_STRIDE)
        position = _tile_position(units, TILE_ORDER)
    else:
        position = (units & ~7) | ((units & 1) << 2) | (units & 2) | ((units >> 2) & 1)
    ptrs = h_ptr + pairs.to(tl.int64)[None, :] * H_STRIDE + position[:, None]
    tl.store(ptrs, h, mask=(units < N // 2)[:, None] & valid[None, :])


@triton.jit
def _columns_down_kernel(
    h_ptr, group_expert_ptr, group_pairs_ptr, routing_weights_ptr, blocks_ptr, scales_ptr,
    bias_ptr, y_ptr, stride_y,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    COLS: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr, INTERPRET: tl.constexpr, TILE_ORDER: tl.constexpr,
    H_STRIDE: tl.constexpr, SCALE_WORDS: tl.constexpr = False, EXTRA: tl.constexpr = 0,
    LB: tl.constexpr = 1,
):  # fmt: skip
    """y[pair, n0 : n0 + BN] (fp32 or bf16) = w_pair · (h_pair @ Wd[expert][rows]^T +
    bd[rows]); h rows H_STRIDE apart, in tile order with TILE_ORDER, else in thread order.
    EXTRA: as gate_up's."""
    G: tl.constexpr = K // 32
    n0 = tl.program_id(0) * BN
    if PDL:
        gdc_wait()  # h
    expert, pairs, valid, _ = _group_columns(
        group_expert_ptr, group_pairs_ptr, tl.program_id(1), TOP_K, COLS
    )
    if expert < 0:
        return
    if EXTRA > 0:
        taken, extra, pairs2, valid2, _tokens2 = _next_group_columns(
            group_expert_ptr, group_pairs_ptr, tl.program_id(1), expert, TOP_K, COLS, EXTRA
        )
        if taken:  # the previous group's program multiplies this one's pairs
            return
    else:
        extra: tl.constexpr = False
    block_rows, scale_rows, row_groups, t, shifts = _expert_rows(
        blocks_ptr, scales_ptr, expert, n0, N, K, BN, SCALE_WORDS, LB
    )
    col_ptrs = h_ptr + tl.where(valid, pairs, 0).to(tl.int64) * H_STRIDE
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    if extra:  # the extra MMA only where it is used
        acc, acc2 = _mxfp4_gemv(
            block_rows, scale_rows, row_groups, t, col_ptrs, tl.where(valid, G, 0),
            BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET, TILE_ORDER, SCALE_WORDS, shifts,
            LB=LB,
            col_ptrs2=h_ptr + tl.where(valid2, pairs2, 0).to(tl.int64) * H_STRIDE,
            col_groups2=tl.where(valid2, G, 0),
        )  # fmt: skip
        if PDL:
            gdc_launch_dependents()
        _store_y(acc2, pairs2, valid2, out_rows, bias, routing_weights_ptr, y_ptr, stride_y, N,
                 INTERPRET)  # fmt: skip
    else:
        acc, _no_extra = _mxfp4_gemv(
            block_rows, scale_rows, row_groups, t, col_ptrs, tl.where(valid, G, 0),
            BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET, TILE_ORDER, SCALE_WORDS, shifts,
            LB=LB,
        )  # fmt: skip
        if PDL:
            gdc_launch_dependents()
    _store_y(acc, pairs, valid, out_rows, bias, routing_weights_ptr, y_ptr, stride_y, N,
             INTERPRET)  # fmt: skip


@triton.jit
def _store_y(acc, pairs, valid, out_rows, bias, routing_weights_ptr, y_ptr, stride_y,
             N: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """down's epilogue: y[pair, out_rows] = w_pair · (acc · 2^62 + bias), the valid pairs,
    in y's dtype (fp32, or bf16 rounded to nearest even)."""
    weights = tl.load(routing_weights_ptr + pairs, mask=valid, other=0.0)
    y = (acc * ACC_SCALE + bias.to(tl.float32)[:, None]) * weights[None, :]
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = _to_bf16(y, INTERPRET)
    ptrs = y_ptr + pairs.to(tl.int64)[None, :] * stride_y + out_rows[:, None]
    tl.store(ptrs, y, mask=(out_rows < N)[:, None] & valid[None, :])
