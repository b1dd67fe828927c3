"""Can a Gluon MXFP4 x bf16 wgmma kernel overlap the decode with the tensor cores? (H200)

The prefill MoE (the grouped columns on wgmma, _moe_columns.py) runs at ~245 TFLOP/s at 2048
tokens: Triton waits for each step's wgmmas right after issuing them, so a warp group decodes
and multiplies in turn (bench/RESULTS.md v10). Here, in Gluon, each 32-column group of the
weights is decoded into wgmma's register operand (the layout of moe_gluon_probe.py) and its two
m64n64k16 wgmmas are left in flight while the next group is decoded
(``warpgroup_mma_wait(1)``); weights and the group's activations come by TMA through a ring of
NUM_BUFFERS steps of 256 columns. The gate_up of one layer at 2048 tokens: 128 experts x 64
pairs (the activations gathered per expert beforehand, in the decode's column order), against
the engine's Triton kernel for the same pairs. TFLOP/s of the 2 · 8192 · 5760 · 2880 MACs.

Then (RESULTS v23) the same product warp-specialized (``_ws_gate_up_kernel``: a 1-warp TMA
producer, 2-3 consumer warp groups of 64 rows on mbarriers, ``setmaxnreg``), its rows of
WS_CONFIGS each runnable alone (``WS_ONLY=i``: a kernel that hangs ends one process), and the
engine's Triton kernel also on the engine's weight layout (bands of 16 rows, permuted words).

    cd bench && python3 moe_wgmma_probe.py [--out results/moe_wgmma_probe.json]
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import os
import statistics
import sys

import torch
import triton
from moe_gluon_probe import _decode_words
from moe_layout_probe import parse_args, write_rows
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gptoss_serve.kernels import _moe_columns as columns
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels import mxfp4_layout
from gptoss_serve.kernels._moe_gemv import _DECODE_PERMUTED_PTX, ORDER_WGMMA
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from kernels import graph_time_ms

E, N, K, COLS, TOKENS = 128, 5760, 2880, 64, 2048
_N, _COLS = gl.constexpr(N), gl.constexpr(COLS)  # in the kernel
_PERMUTED_PTX = gl.constexpr(_DECODE_PERMUTED_PTX.value)
STEPS = triton.cdiv(K, 256)  # 12 steps of 256 columns; TMA reads zeros past K
# (warps: 64 rows per warp group, ring buffers, maxnreg)
CONFIGS = [(4, 2, None), (8, 2, None), (8, 3, None)]
# Warp-specialized (_ws_gate_up_kernel): (consumer warp groups of 64 rows, ring buffers, the
# worker consumers' registers, the kernel's maxnreg, words in the permuted bit order, groups
# a wgmma batch: 0 for one group a wait). 2 consumers on 2 buffers (96 KB) with maxnreg 80 let
# two programs share an SM; without a cap a program takes the SM's registers (3 consumers:
# 16 warps, 128 a thread at launch).
WS_CONFIGS = [
    (2, 2, 112, 80, False, 0), (2, 2, 112, 80, True, 0), (2, 2, 104, 80, True, 4),
    (3, 3, 160, None, True, 4), (3, 3, 160, None, True, 8), (3, 2, 160, None, True, 8),
    (2, 4, 232, None, True, 8),
]  # fmt: skip


@gluon.jit
def _issue(w_desc, x_desc, w_bufs, x_bufs, ready, step, row0, col0, NUM_BUFFERS: gl.constexpr):
    """TMA of step ``step``: the rows' 256 columns and the group's 4 x 64 activation columns."""
    slot = step % NUM_BUFFERS
    bar = ready.index(slot)
    mbarrier.expect(bar, w_desc.block_type.nbytes + 4 * x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [row0, step * 32], bar, w_bufs.index(slot))
    for j in gl.static_range(4):
        tma.async_copy_global_to_shared(x_desc, [col0, step * 256 + 64 * j], bar,
                                        x_bufs.index(slot * 4 + j))  # fmt: skip


@gluon.jit
def _wgmma_gate_up_kernel(w_desc, x_desc, scales_ptr, out_ptr, NUM_STEPS: gl.constexpr,
                          NUM_BUFFERS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """out[e, rows, cols] = 2^62-scaled MXFP4 rows of expert e @ its 64 activation columns."""
    BM: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(16 * num_warps == BM)
    row0 = gl.program_id(1) * _N + gl.program_id(0) * BM  # expert e = program_id(1)
    col0 = gl.program_id(1) * _COLS
    # thread (warp w, lane 4g + t): word t of a group's 4, rows 16w + g and 16w + g + 8
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]] + ([[64, 0]] if num_warps == 8 else []),
        block_bases=[], shape=[BM, 4],
    )  # fmt: skip
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, _COLS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUFFERS, BM, 32], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS * 4, _COLS, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
    for s in gl.static_range(NUM_BUFFERS - 1):
        _issue(w_desc, x_desc, w_bufs, x_bufs, ready, s, row0, col0, NUM_BUFFERS)
    # the 8 scales of a step, for the rows of words_layout, prefetched a step ahead
    scales_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]] + ([[64, 0]] if num_warps == 8 else []),
        block_bases=[], shape=[BM, 8],
    )  # fmt: skip
    s_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, scales_layout))
    s_cols = gl.arange(0, 8, layout=gl.SliceLayout(0, scales_layout))[None, :]
    s_ptrs = scales_ptr + s_rows.to(gl.int64)[:, None] * 90 + s_cols
    next_scales = gl.load(s_ptrs, mask=s_cols < 90, other=0).to(gl.int32)
    zero_t = gl.zeros([1, 4], gl.int32, words_layout)
    acc = gl.zeros([BM, _COLS], gl.float32, mma_layout)
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        scales = next_scales
        next_group = 8 * (step + 1) + s_cols
        next_scales = gl.load(s_ptrs + 8 * (step + 1), mask=next_group < 90, other=0).to(gl.int32)
        mbarrier.wait(ready.index(slot), step // NUM_BUFFERS & 1)
        for c in gl.static_range(8):
            scale = gl.sum(gl.where(s_cols == c, scales, 0), axis=1)  # in registers
            scale = gl.convert_layout(scale, gl.SliceLayout(1, words_layout))
            mult = (scale[:, None] + zero_t + 64) * 0x00800080
            words = w_bufs.index(slot).slice(4 * c, 4, dim=1).load(words_layout)
            tile = _decode_words(words, mult)  # [BM, 4 t, h, a0, a1]
            tile = gl.permute(tile, (0, 4, 3, 1, 2))  # m a1 a0 t h
            a = gl.convert_layout(gl.reshape(tile, [BM, 32]), a_layout, assert_trivial=True)
            b = x_bufs.index(slot * 4 + c // 2).slice((c % 2) * 32, 32, dim=1).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if c == 0:  # the previous step's wgmmas are done: its slot takes step + NB - 1
                gl.thread_barrier()
                fence_async_shared()
                if step + NUM_BUFFERS - 1 < NUM_STEPS:
                    _issue(w_desc, x_desc, w_bufs, x_bufs, ready, step + NUM_BUFFERS - 1, row0,
                           col0, NUM_BUFFERS)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
    out_cols = gl.arange(0, _COLS, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * _COLS + out_cols[None, :], acc)


@gluon.jit
def _decode(words, mult, PERMUTED: gl.constexpr):
    """``moe_gluon_probe._decode_words``, or (PERMUTED) the same values from words in the
    kernels' permuted bit order (mxfp4_layout.permute_words) by the engine's 12-instruction
    decode (_moe_gemv._DECODE_PERMUTED_PTX) instead of 21."""
    if PERMUTED:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _PERMUTED_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, mult],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        return gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)),
                       gl.join(gl.join(o4, o5), gl.join(o6, o7)))  # fmt: skip
    return _decode_words(words, mult)


@gluon.jit
def _ws_producer(w_desc, x_desc, w_bufs, x_bufs, ready, empty, row0, col0,
                 NUM_STEPS: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                 CONSUMERS: gl.constexpr):  # fmt: skip
    """Worker partition (1 warp): each step's TMA (a 64-row box of words per consumer, the 4
    activation boxes) once every consumer freed its slot."""
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        mbarrier.wait(empty.index(slot), (step // NUM_BUFFERS & 1) ^ 1)  # fresh: passes
        bar = ready.index(slot)
        mbarrier.expect(bar, CONSUMERS * w_desc.block_type.nbytes + 4 * x_desc.block_type.nbytes)
        for h in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(w_desc, [row0 + 64 * h, step * 32], bar,
                                            w_bufs.index(slot * CONSUMERS + h))  # fmt: skip
        for j in gl.static_range(4):
            tma.async_copy_global_to_shared(x_desc, [col0, step * 256 + 64 * j], bar,
                                            x_bufs.index(slot * 4 + j))  # fmt: skip


@gluon.jit
def _ws_consumer(w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0, HALF: gl.constexpr,
                 NUM_STEPS: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                 PERMUTED: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """One warp group (a partition of its own): rows [64·HALF, 64·HALF + 64) of the program's
    tile, decoded from the ring into wgmma's register operand, one group's wgmmas meant to be
    in flight while the next group decodes (``warpgroup_mma_wait(1)``; ptxas serializes them
    anyway, C7513: RESULTS v23); frees a slot (one arrive of CONSUMERS) once its last wgmma
    is done."""
    HM: gl.constexpr = 64
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HM, 4],
    )  # fmt: skip
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _COLS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    scales_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HM, 8],
    )  # fmt: skip
    first = row0 + HM * HALF
    s_rows = first + gl.arange(0, HM, layout=gl.SliceLayout(1, scales_layout))
    s_cols = gl.arange(0, 8, layout=gl.SliceLayout(0, scales_layout))[None, :]
    s_ptrs = scales_ptr + s_rows.to(gl.int64)[:, None] * 90 + s_cols
    next_scales = gl.load(s_ptrs, mask=s_cols < 90, other=0).to(gl.int32)
    zero_t = gl.zeros([1, 4], gl.int32, words_layout)
    acc = gl.zeros([HM, _COLS], gl.float32, mma_layout)
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        scales = next_scales
        next_group = 8 * (step + 1) + s_cols
        next_scales = gl.load(s_ptrs + 8 * (step + 1), mask=next_group < 90, other=0).to(gl.int32)
        mbarrier.wait(ready.index(slot), step // NUM_BUFFERS & 1)
        w_slot = w_bufs.index(slot * CONSUMERS + HALF)
        for c in gl.static_range(8):
            scale = gl.sum(gl.where(s_cols == c, scales, 0), axis=1)  # in registers
            scale = gl.convert_layout(scale, gl.SliceLayout(1, words_layout))
            mult = (scale[:, None] + zero_t + 64) * 0x00800080
            words = w_slot.slice(4 * c, 4, dim=1).load(words_layout)
            tile = _decode(words, mult, PERMUTED)  # [HM, 4 t, h, a0, a1]
            tile = gl.permute(tile, (0, 4, 3, 1, 2))  # m a1 a0 t h
            a = gl.convert_layout(gl.reshape(tile, [HM, 32]), a_layout, assert_trivial=True)
            b = x_bufs.index(slot * 4 + c // 2).slice((c % 2) * 32, 32, dim=1).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # c == 0 (unrolled) and step > 0 (a runtime branch): the previous step's last
            # wgmma is done, so this group frees its slot
            if c == 0:  # noqa: SIM102
                if step > 0:
                    fence_async_shared()
                    mbarrier.arrive(empty.index((step + NUM_BUFFERS - 1) % NUM_BUFFERS),
                                    count=1)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out_rows = first + gl.arange(0, HM, layout=gl.SliceLayout(1, mma_layout))
    out_cols = gl.arange(0, _COLS, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * _COLS + out_cols[None, :], acc)


@gluon.jit
def _group_operand(w_slot, scales, c: gl.constexpr, s_cols, zero_t, words_layout: gl.constexpr,
                   a_layout: gl.constexpr, PERMUTED: gl.constexpr):  # fmt: skip
    """Group c (32 columns) of a slot's rows, decoded into wgmma's register operand."""
    scale = gl.sum(gl.where(s_cols == c, scales, 0), axis=1)  # in registers
    scale = gl.convert_layout(scale, gl.SliceLayout(1, words_layout))
    mult = (scale[:, None] + zero_t + 64) * 0x00800080
    words = w_slot.slice(4 * c, 4, dim=1).load(words_layout)
    tile = _decode(words, mult, PERMUTED)  # [HM, 4 t, h, a0, a1]
    tile = gl.permute(tile, (0, 4, 3, 1, 2))  # m a1 a0 t h
    return gl.convert_layout(gl.reshape(tile, [tile.shape[0], 32]), a_layout, assert_trivial=True)


@gluon.jit
def _four_operands(w_slot, scales, g: gl.constexpr, s_cols, zero_t, words_layout: gl.constexpr,
                   a_layout: gl.constexpr, PERMUTED: gl.constexpr):  # fmt: skip
    """Groups g .. g + 3 of a slot's rows as four register operands."""
    return (
        _group_operand(w_slot, scales, g, s_cols, zero_t, words_layout, a_layout, PERMUTED),
        _group_operand(w_slot, scales, g + 1, s_cols, zero_t, words_layout, a_layout, PERMUTED),
        _group_operand(w_slot, scales, g + 2, s_cols, zero_t, words_layout, a_layout, PERMUTED),
        _group_operand(w_slot, scales, g + 3, s_cols, zero_t, words_layout, a_layout, PERMUTED),
    )


@gluon.jit
def _four_mmas(a0, a1, a2, a3, x_bufs, box, acc):
    """The 8 wgmmas of four groups (x boxes ``box`` and ``box`` + 1), left in flight."""
    first = x_bufs.index(box)
    second = x_bufs.index(box + 1)
    acc = warpgroup_mma(a0, first.slice(0, 32, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(a1, first.slice(32, 32, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(a2, second.slice(0, 32, dim=1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(a3, second.slice(32, 32, dim=1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _ws_consumer_batched(w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                         HALF: gl.constexpr, NUM_STEPS: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                         PERMUTED: gl.constexpr, BATCH: gl.constexpr,
                         CONSUMERS: gl.constexpr):  # fmt: skip
    """``_ws_consumer`` as the engine's Triton kernel orders its wgmmas (ptxas accepts that):
    BATCH groups (4: 128 columns, or 8) decoded into register operands first, then their
    2·BATCH wgmmas back to back and one wait for all; the slot is freed at the end of its
    step. HALF: the consumer's index (rows [64·HALF, 64·HALF + 64) of the program's)."""
    HM: gl.constexpr = 64
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HM, 4],
    )  # fmt: skip
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _COLS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    scales_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HM, 8],
    )  # fmt: skip
    first = row0 + HM * HALF
    s_rows = first + gl.arange(0, HM, layout=gl.SliceLayout(1, scales_layout))
    s_cols = gl.arange(0, 8, layout=gl.SliceLayout(0, scales_layout))[None, :]
    s_ptrs = scales_ptr + s_rows.to(gl.int64)[:, None] * 90 + s_cols
    next_scales = gl.load(s_ptrs, mask=s_cols < 90, other=0).to(gl.int32)
    zero_t = gl.zeros([1, 4], gl.int32, words_layout)
    acc = gl.zeros([HM, _COLS], gl.float32, mma_layout)
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        scales = next_scales
        next_group = 8 * (step + 1) + s_cols
        next_scales = gl.load(s_ptrs + 8 * (step + 1), mask=next_group < 90, other=0).to(gl.int32)
        mbarrier.wait(ready.index(slot), step // NUM_BUFFERS & 1)
        w_slot = w_bufs.index(slot * CONSUMERS + HALF)
        for batch in gl.static_range(8 // BATCH):
            a0, a1, a2, a3 = _four_operands(w_slot, scales, BATCH * batch, s_cols, zero_t,
                                            words_layout, a_layout, PERMUTED)  # fmt: skip
            if BATCH == 8:
                a4, a5, a6, a7 = _four_operands(w_slot, scales, 4, s_cols, zero_t, words_layout,
                                                a_layout, PERMUTED)  # fmt: skip
            acc = _four_mmas(a0, a1, a2, a3, x_bufs, slot * 4 + 2 * batch * (BATCH // 4), acc)
            if BATCH == 8:
                acc = _four_mmas(a4, a5, a6, a7, x_bufs, slot * 4 + 2, acc)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
    out_rows = first + gl.arange(0, HM, layout=gl.SliceLayout(1, mma_layout))
    out_cols = gl.arange(0, _COLS, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * _COLS + out_cols[None, :], acc)


@gluon.jit
def _ws_gate_up_kernel(w_desc, x_desc, scales_ptr, out_ptr, NUM_STEPS: gl.constexpr,
                       NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PERMUTED: gl.constexpr = False, BATCH: gl.constexpr = 0,
                       CONSUMERS: gl.constexpr = 2):  # fmt: skip
    """``_wgmma_gate_up_kernel``'s product, warp-specialized: a 1-warp TMA producer and
    BM / 64 consumer warp groups (2, or 3 with BATCH) of 64 rows each on the same activation
    tiles, coupled only through the ring's (ready, empty) mbarriers. BATCH 0:
    ``_ws_consumer``, else ``_ws_consumer_batched`` with that many groups a batch."""
    BM: gl.constexpr = 64 * CONSUMERS
    gl.static_assert(w_desc.block_type.shape[0] == 64)
    gl.static_assert((CONSUMERS == 2) | ((CONSUMERS == 3) & (BATCH > 0)))
    row0 = gl.program_id(1) * _N + gl.program_id(0) * BM  # expert e = program_id(1)
    col0 = gl.program_id(1) * _COLS
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUFFERS * CONSUMERS, 64, 32],
                                       w_desc.layout)  # fmt: skip
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS * 4, _COLS, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrive from each consumer
    fence_async_shared()
    if BATCH == 0:
        gl.warp_specialize(
            [
                (_ws_consumer, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0, 0,
                                NUM_STEPS, NUM_BUFFERS, PERMUTED, CONSUMERS)),
                (_ws_consumer, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0, 1,
                                NUM_STEPS, NUM_BUFFERS, PERMUTED, CONSUMERS)),
                (_ws_producer, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, row0, col0,
                                NUM_STEPS, NUM_BUFFERS, CONSUMERS)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
    elif CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_ws_consumer_batched, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                                        0, NUM_STEPS, NUM_BUFFERS, PERMUTED, BATCH, CONSUMERS)),
                (_ws_consumer_batched, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                                        1, NUM_STEPS, NUM_BUFFERS, PERMUTED, BATCH, CONSUMERS)),
                (_ws_producer, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, row0, col0,
                                NUM_STEPS, NUM_BUFFERS, CONSUMERS)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_ws_consumer_batched, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                                        0, NUM_STEPS, NUM_BUFFERS, PERMUTED, BATCH, CONSUMERS)),
                (_ws_consumer_batched, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                                        1, NUM_STEPS, NUM_BUFFERS, PERMUTED, BATCH, CONSUMERS)),
                (_ws_consumer_batched, (w_bufs, x_bufs, ready, empty, scales_ptr, out_ptr, row0,
                                        2, NUM_STEPS, NUM_BUFFERS, PERMUTED, BATCH, CONSUMERS)),
                (_ws_producer, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, row0, col0,
                                NUM_STEPS, NUM_BUFFERS, CONSUMERS)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, 24],
        )  # fmt: skip


def virtual_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, K] -> [T, STEPS · 256] in the decode's column order (moe_gluon_probe.virtual_order,
    row by row)."""
    padded = torch.nn.functional.pad(x, (0, STEPS * 256 - x.shape[1]))
    groups = padded.view(x.shape[0], -1, 4, 2, 2, 2)  # [T, group, t, h, a1, a0]
    return groups.permute(0, 1, 4, 5, 2, 3).reshape(x.shape[0], -1).contiguous()


def expert_reference(blocks, scales, x_cols: torch.Tensor, e: int) -> torch.Tensor:
    """fp32 [N, COLS]: expert e's dequantized rows times its activation columns."""
    rows = slice(e * N, (e + 1) * N)
    weights = dequantize_mxfp4(blocks[rows].view(N, -1, 16), scales[rows], torch.float32)
    return weights @ x_cols.float().T


def pairs_of_experts(device: str) -> torch.Tensor:
    """[E, COLS] pair ids (4 · token + slot): 64 distinct tokens for each expert, every token 4
    times in all (TOKENS · 4 = E · COLS)."""
    i = torch.arange(E * COLS, device=device)
    return (4 * (i % TOKENS) + i // TOKENS).view(E, COLS).to(torch.int32)


def main() -> int:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (E * N, K // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(120, 134, (E * N, K // 32), dtype=torch.uint8, device="cuda")
    x = torch.randn(TOKENS, K, device="cuda").to(torch.bfloat16)
    pairs = pairs_of_experts("cuda")
    tokens = (pairs // 4).long()
    xv = virtual_rows(x)  # [TOKENS, 3072]
    xg = xv[tokens.view(-1)].contiguous()  # [E · COLS, 3072]: each expert's columns
    out = torch.empty(E * N, COLS, device="cuda")
    flop = 2 * E * COLS * N * K
    rows = []
    check = [0, 77]  # experts checked against the dequantized weights
    reference = {e: expert_reference(blocks, scales, x[tokens[e]], e) for e in check}

    def report(name: str, us: float, got: dict) -> None:
        err = max(((got[e] - reference[e]).abs().max() / reference[e].abs().max()).item()
                  for e in check)  # fmt: skip
        tflops = flop / (us * 1e-6) / 1e12
        sys.stdout.write(f"{name:<44} {us:9.1f} {tflops:8.1f} {err:8.1e}\n")
        rows.append({"config": name, "us": round(us, 1), "tflops": round(tflops, 1),
                     "max_rel": err})  # fmt: skip

    sys.stdout.write(f"{'gate_up, 2048 tokens':<44} {'us':>9} {'TFLOP/s':>8} {'max_rel':>8}\n")
    ws_only = os.environ.get("WS_ONLY")  # one WS_CONFIGS row alone: a hang ends one process
    w_words = blocks.view(torch.int32)
    if ws_only is None:
        rows.extend(time_triton(x, pairs, blocks, scales, flop))
        time_plain(w_words, xg, scales, out, check, report)
    ws_configs = WS_CONFIGS if ws_only is None else [WS_CONFIGS[int(ws_only)]]
    time_warp_specialized(w_words, xg, scales, out, check, report, ws_configs)
    return write_rows(args.out, rows)


def time_triton(x, pairs, blocks, scales, flop) -> list[dict]:
    """The engine's Triton kernel on the same pairs (its table row for 2048 tokens), on the
    checkpoint's rows and on the engine's layout (bands of 16 rows, words permuted: its
    12-instruction decode, whole steps)."""
    tiles = small.decode_tiles_for(TOKENS)
    x_tile = small.tile_order(x, ORDER_WGMMA)
    width = x_tile.shape[1]
    h = torch.empty(E * COLS, width, dtype=torch.bfloat16, device="cuda")
    bias = torch.zeros(E, N, dtype=torch.bfloat16, device="cuda")
    group_expert = torch.arange(E, dtype=torch.int32, device="cuda")
    rows = mxfp4_layout.STEP_ROWS
    layouts = [
        ("checkpoint rows", blocks, scales, 1),
        (f"bands of {rows}", mxfp4_layout.to_step_rows(blocks.view(E * N, K // 32, 16), rows),
         mxfp4_layout.scales_to_step_rows(scales, rows), rows),
    ]  # fmt: skip
    results = []
    for layout, layout_blocks, layout_scales, lb in layouts:

        def triton_launch(layout_blocks=layout_blocks, layout_scales=layout_scales, lb=lb) -> None:
            columns._columns_gate_up_kernel[(N // tiles.gate_up_rows, E)](
                x_tile, group_expert, pairs, layout_blocks, layout_scales, bias, h, 1.702, 1e30,
                H=K, N=N, TOP_K=4, BN=tiles.gate_up_rows, COLS=COLS,
                **small._full_steps(K, whole=lb > 1), NUM_STAGES=tiles.gate_up_stages, PTX=True,
                PDL=False, INTERPRET=False, num_warps=tiles.gate_up_warps,
                num_stages=tiles.gate_up_stages, X_STRIDE=width, TILE_ORDER=tiles.order,
                H_STRIDE=width, SCALE_WORDS=tiles.scale_words, LB=lb,
            )  # fmt: skip

        us = statistics.median(graph_time_ms(triton_launch, repeats=20)) * 1e3
        tflops = flop / (us * 1e-6) / 1e12
        name = f"triton columns {tiles.gate_up_rows} rows {tiles.gate_up_warps} warps, {layout}"
        sys.stdout.write(f"{name:<44} {us:9.1f} {tflops:8.1f} {'(swiglu)':>8}\n")
        results.append({"config": name, "us": round(us, 1), "tflops": round(tflops, 1)})
    return results


def time_plain(w_words, xg, scales, out, check, report) -> None:
    """``_wgmma_gate_up_kernel`` in every CONFIGS row."""
    for warps, buffers, maxnreg in CONFIGS:
        bm = 16 * warps
        w_layout = gl.NVMMASharedLayout.get_default_for([bm, 32], gl.int32)
        w_desc = TensorDescriptor(w_words, list(w_words.shape), list(w_words.stride()), [bm, 32],
                                  w_layout)  # fmt: skip
        x_layout = gl.NVMMASharedLayout.get_default_for([COLS, 64], gl.bfloat16)
        x_desc = TensorDescriptor(xg, list(xg.shape), list(xg.stride()), [COLS, 64], x_layout)
        options = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})

        def launch(w_desc=w_desc, x_desc=x_desc, bm=bm, buffers=buffers, options=options) -> None:
            _wgmma_gate_up_kernel[(N // bm, E)](
                w_desc, x_desc, scales, out, NUM_STEPS=STEPS, NUM_BUFFERS=buffers, **options
            )

        name = f"gluon wgmma {bm} rows {warps} warps {buffers} buf"
        try:
            us = statistics.median(graph_time_ms(launch, repeats=20)) * 1e3
        except Exception as error:  # a shape that does not build: report it, go on
            sys.stdout.write(f"{name}: {error!r}\n")
            continue
        got = {e: out[e * N : (e + 1) * N] * 2.0**62 for e in check}
        report(name, us, got)


def time_warp_specialized(w_words, xg, scales, out, check, report, configs) -> None:
    """``_ws_gate_up_kernel`` in each of ``configs`` (WS_CONFIGS rows), reported as main's."""
    permuted_words = mxfp4_layout.permute_words(w_words.view(torch.uint8).view(-1, 16))
    permuted_words = permuted_words.view(torch.int32).view(w_words.shape)
    x_layout = gl.NVMMASharedLayout.get_default_for([COLS, 64], gl.bfloat16)
    x_desc = TensorDescriptor(xg, list(xg.shape), list(xg.stride()), [COLS, 64], x_layout)
    for consumers, buffers, regs, maxnreg, permuted, batch in configs:
        out.fill_(float("nan"))
        bm = 64 * consumers
        words = permuted_words if permuted else w_words
        w_layout = gl.NVMMASharedLayout.get_default_for([64, 32], gl.int32)
        w_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [64, 32],
                                  w_layout)  # fmt: skip
        options = {"num_warps": 4} | ({"maxnreg": maxnreg} if maxnreg else {})

        def ws_launch(buffers=buffers, regs=regs, options=options, permuted=permuted,
                      batch=batch, w_desc=w_desc, bm=bm) -> None:  # fmt: skip
            _ws_gate_up_kernel[(N // bm, E)](
                w_desc, x_desc, scales, out, NUM_STEPS=STEPS, NUM_BUFFERS=buffers,
                CONSUMER_REGS=regs, PERMUTED=permuted, BATCH=batch, CONSUMERS=bm // 64,
                **options,
            )  # fmt: skip

        name = (f"gluon ws {consumers}x64 rows {buffers} buf {regs} regs maxnreg {maxnreg}"
                f"{' permuted' * permuted} batch {batch}")  # fmt: skip
        try:
            us = statistics.median(graph_time_ms(ws_launch, repeats=20)) * 1e3
        except Exception as error:  # a shape that does not build: report it, go on
            sys.stdout.write(f"{name}: {error!r}\n")
            continue
        report(name, us, {e: out[e * N : (e + 1) * N] * 2.0**62 for e in check})


if __name__ == "__main__":
    sys.exit(main())
