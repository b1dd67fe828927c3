"""Paged decode attention (flash-decoding): one program per (KV head, split, sequence).

Each program multiplies all GROUP query heads of its KV head (padded to 16 rows for the
tensor cores) against its slice of the sequence's visible keys, so each K/V row is read
once per group. With more than one split, programs write partial (max, sum, unnormalised
output) and a second kernel merges them and folds in the sink; with one split the first
kernel finishes the job itself (no second launch, no partials: large batches).
"""

# Triton convention: compile-time constants are UPPER_CASE parameters, and kernels (and
# the launchers that mirror them) take their tensors and strides positionally.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._attention_common import (
    LOG2E,
    LOG2E_FLOAT,
    NO_SCORE,
    key_row_offsets,
    load_rows,
    softmax_update,
)
from gptoss_serve.kernels._moe_common import _prefetch_line
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.kv_dtype import FP8

MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # target grid: several programs per SM, so many loads are in flight


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int  # keys per loop iteration
    split_min: int  # fewest keys a split is given (a multiple of block_n)
    num_warps: int
    num_stages: int
    programs_per_sm: int = PROGRAMS_PER_SM  # the grid's target (choose_num_splits)
    # Each split's first K/V tile asked of L2 before the PDL wait (_decode_kernel)
    prefetch: bool = False
    merge_warps: int = 4  # the split merge's (_combine_kernel: one program per head, sequence)


# H200, by batch (the first entry with batch <= its bound serves it; a CUDA graph's grid is
# fixed by its batch, so the choice is too). Many sequences: 64 keys x 128 B x (K + V) = 16
# KiB per iteration; the block-table load takes one pipeline stage of its own, so
# num_stages=5 keeps two K/V tiles in flight (3 or 4 keep one); sm_90 AOT build: 80
# registers, 37 KiB shared memory, mma.sync (16-row tiles), cp.async. Up to 16 sequences,
# 128-key tiles on 4 stages (bench/RESULTS.md v12; PDL, TB/s, 64 -> 128 keys): batch 1 1k /
# 32k 0.37 / 2.88 -> 0.43 / 2.97, batch 8 8k / 128k 2.83 / 3.54 -> 3.22 / 4.12, batch 16 1k
# / 32k 1.86 / 3.95 -> 2.36 / 4.17; the whole 120b step at batch 1 / 16, 1k context, 2.44 /
# 13.00 -> 2.40 / 12.87 ms. At batch 32 they lose from 8k context (3.90 -> 3.24 TB/s).
# From 33 sequences a grid of 2 programs an SM, i.e. one split (no merge kernel) where 4
# gave two: the whole step at batch 64, 1k / 8k context, 22.78-22.85 -> 22.59 / 27.66-27.74
# -> 27.15 ms (at batch 32, 3 splits -> 2: even). Since v17 the first row's programs ask L2 for
# their first K/V tile before the PDL wait, while the q/k/v kernel before them runs (it lets
# them launch at its start): at batch 1 every split is one tile up to 8k keys. Whole 120b
# step, H100 (bench/RESULTS.md v17): batch 1 1k / 8k / 32k 2.567 / 2.700 / 3.000 -> 2.569 /
# 2.679 / 2.984 ms, batch 2 3.635 -> 3.608; batch 8 / 16 even (8.057-8.083 / 13.93 against
# 8.069-8.090 / 13.93-13.95; there the q/k/v run through cuBLAS and nothing waits early).
# Past 32 sequences every (sequence, KV head) is one program (2 an SM wanted), so the grid's
# waves decide, and the 64- and 128-key tiles fill them at different batches (v23 item 6:
# kernel alone with PDL, TB/s at 1k context, 64 / 128 keys: batch 40 2.99-3.07 / 2.96-2.97,
# 48 3.40-3.51 / 3.16-3.19, 56 2.80-2.85 / 3.42-3.47, 64 2.81-3.04 / 3.56-3.65, 80 3.25-3.28 /
# 3.10-3.15, 96 3.59-3.63 / 3.42-3.47, 112 2.79-2.85 / 3.67-3.71, 128 3.08-3.14 / 3.77-3.86,
# 160 3.65-3.73 / 3.65-3.70, 256 at 1.5k 3.88-3.95 / 4.07-4.10, 512 4.01-4.04 / 4.13-4.16;
# the whole 120b step at batch 64, 1k: 17.65-17.72 -> 17.46 ms; 4 stages as 3). The rows
# follow the decode graphs' padded sizes (engine/cuda_graphs.py: 40, 48, ... 64, 80, 96, 112,
# 128, 160, ...).
_MANY_SEQS = DecodeTiles(block_n=64, split_min=128, num_warps=4, num_stages=5)
_ONE_SPLIT = dataclasses.replace(_MANY_SEQS, programs_per_sm=2)
_ONE_SPLIT_WIDE = DecodeTiles(block_n=128, split_min=128, num_warps=4, num_stages=3,
                              programs_per_sm=2)  # fmt: skip
# 17-32 sequences likewise (v23 item 7; TB/s, the row before / 128 keys on 3 stages, splits
# for 4 programs an SM / one split): batch 24 1k / 8k 2.18 / 3.21 -> 2.71 / 3.73 / 2.61 /
# 3.46; batch 32 1k / 2k / 8k / 32k 2.42 / 2.96 / 3.74 / 3.96 -> 2.52 / 2.99 / 3.14 / - and
# 2.76 / 3.26 / 3.74 / 3.91; the whole step at batch 32, 1k: 13.20-13.25 -> 13.12 ms.
# Up to 16 sequences the split merge runs on 2 warps, not 4 (v27; the whole step, PDL, 1k
# context: batch 1 / 4 / 8 / 16 2.137-2.138 / 4.160-4.166 / 5.889-5.948 / 9.16-9.24 ->
# 2.130-2.133 / 4.156 / 5.865-5.915 / 9.100-9.108 ms; batch 1 at 8k even; 24 even).
_FEW_SEQS = DecodeTiles(
    block_n=128, split_min=128, num_warps=4, num_stages=4, prefetch=True, merge_warps=2
)
GPU_TILES: tuple[tuple[int, DecodeTiles], ...] = (
    (16, _FEW_SEQS),
    (24, dataclasses.replace(_ONE_SPLIT_WIDE, programs_per_sm=PROGRAMS_PER_SM)),
    (32, _ONE_SPLIT_WIDE),
    (48, _ONE_SPLIT),
    (64, _ONE_SPLIT_WIDE),
    (96, _ONE_SPLIT),
    (1 << 30, _ONE_SPLIT_WIDE),
)
# Interpreter: tiny tiles so small test sequences still span several tiles and splits.
CPU_TILES = DecodeTiles(block_n=16, split_min=16, num_warps=1, num_stages=1)


# Over an FP8 cache (kernels/kv_dtype.py) a tile holds half the bytes, and up to 16 sequences
# take 6 stages instead of 4: H100, us a call (bench/RESULTS.md v19 item 4), bs1 1k / 8k /
# 32k / 128k 5.2-5.4 / 11.3-11.7 / 25.5 / 79.4-81.7 -> 5.3 / 12.0 / 25.5 / 77.3, bs16 8k
# 94.8-95.0 -> 81.8. The other rows were not measured over FP8.
FP8_STAGES_UP_TO_16 = 6


def gpu_tiles_for(batch: int, fp8_cache: bool = False) -> DecodeTiles:
    """The GPU_TILES row serving a decode batch of ``batch`` sequences (over an FP8 cache
    with ``fp8_cache``)."""
    bound, tiles = next(((b, t) for b, t in GPU_TILES if batch <= b), GPU_TILES[-1])
    if fp8_cache and bound <= 16:
        return dataclasses.replace(tiles, num_stages=FP8_STAGES_UP_TO_16)
    return tiles


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: behave like an H200 so the tests see the same splits


def choose_num_splits(
    batch: int, num_kv_heads: int, max_keys: int, sms: int, split_min: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:  # fmt: skip
    """Splits per (sequence, KV head): enough programs for ``programs_per_sm`` waves over all
    SMs, but never more than the longest visible context can fill at ``split_min`` keys each."""
    wanted = triton.cdiv(programs_per_sm * sms, batch * num_kv_heads)
    fillable = triton.cdiv(max(max_keys, 1), split_min)
    return max(1, min(wanted, fillable, MAX_SPLITS))


@triton.jit
def _split_bounds(seq_len, window, num_splits, split_id, HAS_WINDOW: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr):  # fmt: skip
    """Keys [start, end) of one split and the number of splits this sequence uses (>= 1).

    The sequence's visible keys are divided evenly (in whole tiles, at least SPLIT_MIN keys
    per split) at run time, so a grid fixed at CUDA-graph capture serves every length.
    """
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    num_keys = seq_len - first_key
    split_len = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, SPLIT_MIN)
    start = first_key + split_id * split_len
    end = tl.minimum(start + split_len, seq_len)
    num_active = tl.maximum(tl.cdiv(num_keys, split_len), 1)
    return start, end, num_active


@triton.jit
def _prefetch_tile(k_ptr, v_ptr, table_row, start, end, head_offset, stride_cb, stride_ct,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Asks L2 for the K and V rows of keys [start, min(start + BLOCK_N, end)) of one KV head
    (a 64-dim bf16 row is one 128-byte line)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_mask = keys < end
    offsets = key_row_offsets(table_row, keys, key_mask, stride_cb, stride_ct, PAGE_SIZE)
    offsets += head_offset
    _prefetch_line(k_ptr + offsets, key_mask)
    _prefetch_line(v_ptr + offsets, key_mask)


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ob, stride_oh,
    window, num_splits, qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_MIN: tl.constexpr, HAS_WINDOW: tl.constexpr, FOLD_SINK: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    """Lengths and block tables are the step's uploads, not the previous kernel's output, so
    they are read before the PDL wait. PREFETCH: so are the split's first tile of K and V rows
    asked of L2 (lines of earlier steps' keys; the newest, this step's, is written through L2
    by the previous kernel, so the loop's loads after the wait see it either way)."""
    kv_head = tl.program_id(0)  # fastest: the 8 heads of one split share DRAM pages
    split_id = tl.program_id(1)
    seq = tl.program_id(2)
    table_row = table_ptr + seq * stride_tb
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end, num_active = _split_bounds(
        seq_len, window, num_splits, split_id, HAS_WINDOW, BLOCK_N, SPLIT_MIN
    )
    if PREFETCH:
        _prefetch_tile(k_ptr, v_ptr, table_row, start, end, kv_head * stride_ch, stride_cb,
                       stride_ct, PAGE_SIZE, BLOCK_N)  # fmt: skip
    if PDL:  # q and this step's K/V come from the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_G)  # query heads of this group, padded to >= 16 rows
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    if split_id >= num_active:
        if not FOLD_SINK:  # an empty split: the merge gives it weight 0 (no length needed)
            part = (seq * NUM_HEADS + heads) * num_splits + split_id
            tl.store(part_m_ptr + part, tl.full([BLOCK_G], float("-inf"), tl.float32),
                     mask=row_mask)  # fmt: skip
        return

    dims = tl.arange(0, HEAD_DIM)
    q = load_rows(q_ptr + seq * stride_qb, heads * stride_qh, dims, row_mask)  # [G, D]
    if FOLD_SINK:  # the sink joins the softmax as one more logit per head
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_G], NO_SCORE, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)

    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        offsets = key_row_offsets(table_row, keys, key_mask, stride_cb, stride_ct, PAGE_SIZE)
        offsets += kv_head * stride_ch
        k = load_rows(k_ptr, offsets, dims, key_mask)  # [N, D]
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [G, N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        v = load_rows(v_ptr, offsets, dims, key_mask)  # [N, D]
        m_i, l_i, acc = softmax_update(scores, v, m_i, l_i, acc)

    if FOLD_SINK:
        out_rows = out_ptr + seq * stride_ob + heads * stride_oh
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + dims[None, :], out, mask=row_mask[:, None])
    else:
        # partials [B, A, S] and [B, A, S, D], fp32
        part = (seq * NUM_HEADS + heads) * num_splits + split_id
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    sinks_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (head, sequence): merge the splits' partials and the sink logit. Every
    split program wrote its maximum (-inf: an empty split, whose sum and output are never
    written), so all loads go out at once, with no wait for the sequence's length.

    PDL: the next kernel (the o GEMV, which loads its weights before its own wait) may launch
    as these programs start, not once the attention before them is done; the sink, a weight,
    is read before the wait. Whole 120b step, H100, batch 1 at 8k context 2.670-2.688 ->
    2.644-2.651 ms, at 1k and batch 2 within 0.3% (bench/RESULTS.md v17)."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
    if PDL:
        gdc_wait()
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + splits  # [S]
    split_max = tl.load(part_m_ptr + part, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_mask[:, None], other=0.0)  # fmt: skip
    live = split_max > float("-inf")  # empty splits: sum and output unwritten (any bits)
    m_all = tl.maximum(tl.max(split_max, 0), sink)
    weight = tl.exp2(split_max - m_all)  # [S], 0 for empty splits
    total = tl.sum(tl.where(live, split_sum * weight, 0.0), 0) + tl.exp2(sink - m_all)
    out = tl.sum(tl.where(live[:, None], acc * weight[:, None], 0.0), 0) / total  # [D]
    out_row = out_ptr + seq * stride_ob + head * stride_oh
    tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty))


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    out: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    max_seq_len: int | None,
    pdl: bool = False,
) -> torch.Tensor:
    """Shapes as in attention.paged_attention_decode; ``out`` [B, A, D] is written; ``pdl``:
    programmatic dependent launches (kernels/launch.py)."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tiles = gpu_tiles_for(batch, k_cache.dtype == FP8) if q.is_cuda else CPU_TILES
    max_keys = block_tables.shape[1] * page_size if max_seq_len is None else max_seq_len
    if window is not None:
        max_keys = min(max_keys, window)
    num_splits = choose_num_splits(
        batch, num_kv_heads, max_keys, num_sms(q.device), tiles.split_min, tiles.programs_per_sm
    )
    fold_sink = num_splits == 1
    part_shape = (batch, num_heads, num_splits)
    part_m = out if fold_sink else q.new_empty(part_shape, dtype=torch.float32)
    part_l = out if fold_sink else q.new_empty(part_shape, dtype=torch.float32)
    part_acc = out if fold_sink else q.new_empty((*part_shape, head_dim), dtype=torch.float32)
    launcher(_decode_kernel)[(num_kv_heads, num_splits, batch)](
        q, k_cache, v_cache, block_tables, seq_lens, sinks, out, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), window or 0, num_splits,
        qk_scale=scale * LOG2E_FLOAT, NUM_HEADS=num_heads, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=tiles.block_n, SPLIT_MIN=tiles.split_min, HAS_WINDOW=window is not None,
        FOLD_SINK=fold_sink, PDL=pdl, PREFETCH=tiles.prefetch and q.is_cuda,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if not fold_sink:
        launcher(_combine_kernel)[(num_heads, batch)](
            sinks, part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            PDL=pdl, num_warps=tiles.merge_warps, launch_pdl=pdl,
        )  # fmt: skip
    return out
