"""Triton body of the dense projection for a few tokens on the tensor cores (``linear.py``):
3 to ``linear.MMA_MAX_TOKENS`` activation rows times a row-major bf16 weight.

From 3 tokens the CUDA-core GEMV (_linear.py) loses to cuBLAS (its FMAs grow with the token
count), but cuBLAS picks GEMM tiles for a skinny product that read the weights at ~2 TB/s on
an H100 (bench/RESULTS.md v18: q/k/v and o at batch 64). Here the weights are the MMA's
left operand: every program owns BM weight rows and streams them over K in BK-column steps
through a software pipeline (cp.async, NUM_STAGES deep), with the tokens as the MMA's
columns (padded to at least 16); fp32 accumulation, then bias and one store.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._linear import dense_operands
from gptoss_serve.kernels._moe_common import _dot, _to_bf16
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.linear import MmaTiles


@triton.jit
def _linear_mma_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, num_tokens, num_rows,
    stride_x, stride_out,
    K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, T_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, PDL: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr, SPLIT_K: tl.constexpr = 1,
):  # fmt: skip
    """out[m, n0:n0 + BM] = x[m] @ W[n0:n0 + BM]^T (+ b) for every token m < num_tokens;
    program (row tile, K part) of SPLIT_K parts."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_mask = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # the last program's extra rows re-read a real row
    tokens = tl.arange(0, T_PAD)
    token_mask = tokens < num_tokens
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    acc = _weight_rows_times_x(x_ptr, weight_ptr, rows, tokens, token_mask, stride_x, K, BM,
                               BK, T_PAD, NUM_STAGES, SPLIT_K, INTERPRET)  # fmt: skip
    if SPLIT_K > 1:
        last, acc = _split_k_sum(acc, partial_ptr, counter_ptr, BM, T_PAD, SPLIT_K)
        if not last:
            return
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    out = out_ptr + tokens[None, :] * stride_out + rows[:, None]
    mask = row_mask[:, None] & token_mask[None, :]
    if OUT_FP32:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, _to_bf16(acc, INTERPRET), mask=mask)


@triton.jit
def _weight_rows_times_x(
    x_ptr, weight_ptr, rows, tokens, token_mask, stride_x, K: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, T_PAD: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """acc [BM, T_PAD] fp32 = W[rows, part's columns] @ x[tokens, part's columns]^T, the part
    being program_id(1)'s of SPLIT_K (whole BK steps; a part past the end adds nothing)."""
    PART_STEPS: tl.constexpr = triton.cdiv(triton.cdiv(K, BK), SPLIT_K)
    k_start = tl.program_id(1) * (PART_STEPS * BK)
    k_end = tl.minimum(k_start + PART_STEPS * BK, K)
    acc = tl.zeros([BM, T_PAD], tl.float32)
    w_ptrs = weight_ptr + rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    x_ptrs = x_ptr + tokens[None, :] * stride_x + tl.arange(0, BK)[:, None]
    for step in tl.range(0, PART_STEPS, num_stages=NUM_STAGES):
        k0 = k_start + step * BK
        k_mask = (k0 + tl.arange(0, BK)) < k_end
        w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)  # [BM, BK]
        x = tl.load(x_ptrs + k0, mask=k_mask[:, None] & token_mask[None, :], other=0.0)
        acc = _dot(w, x, acc, INTERPRET)  # [BM, T_PAD]
    return acc


@triton.jit
def _split_k_sum(acc, partial_ptr, counter_ptr, BM: tl.constexpr, T_PAD: tl.constexpr,
                 SPLIT_K: tl.constexpr):  # fmt: skip
    """(whether this program is its row tile's last, and then Σ the tile's parts in part
    order): each program stores its fp32 tile to ``partial`` [row tiles, SPLIT_K, BM, T_PAD]
    and takes a ticket of the tile's counter (acq_rel, as _moe_decode._route_when_last); the
    last one reads every part back through L2 (.cg) and sets the counter back to 0 for the
    next call on the stream."""
    tile = tl.program_id(0)
    offsets = tl.arange(0, BM)[:, None] * T_PAD + tl.arange(0, T_PAD)[None, :]
    parts = partial_ptr + tile.to(tl.int64) * (SPLIT_K * BM * T_PAD) + offsets
    tl.store(parts + tl.program_id(1) * (BM * T_PAD), acc)
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    last = ticket == SPLIT_K - 1
    total = tl.zeros([BM, T_PAD], tl.float32)
    if last:
        for part in tl.static_range(SPLIT_K):
            total += tl.load(parts + part * (BM * T_PAD), cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed")
    return last, total


def split_k_buffers(
    tiles: MmaTiles, num_rows: int, k: int, t_pad: int, device: torch.device
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(K parts, the fp32 partial tiles, the row tiles' counters) of a launch; no buffers
    without a split. The counters are zeros that every launch leaves at zero: one tensor per
    device, allocated at its first split launch (eager warm-up, before any graph capture),
    shared by launches that run in stream order."""
    split = tiles.split_k(num_rows, k)
    if split == 1:
        return 1, None, None
    row_tiles = triton.cdiv(num_rows, tiles.rows)
    partial = torch.empty(row_tiles * split * tiles.rows * t_pad, dtype=torch.float32,
                          device=device)  # fmt: skip
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < row_tiles:
        counters = torch.zeros(max(row_tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return split, partial, counters


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def linear_mma_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: MmaTiles,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Launch: x [T, K] (unit stride along K; T ≤ 256), weight [N, K] -> [T, N] out_dtype."""
    x, weight, out = dense_operands(x, weight, out_dtype)
    num_tokens, k = x.shape
    num_rows = weight.shape[0]
    if num_tokens == 0:
        return out
    if num_tokens > 256:
        raise ValueError(f"the MMA's token columns are at most 256, got {num_tokens} tokens")
    t_pad = max(16, triton.next_power_of_2(num_tokens))
    split, partial, counters = split_k_buffers(tiles, num_rows, k, t_pad, x.device)
    launcher(_linear_mma_kernel)[(triton.cdiv(num_rows, tiles.rows), split)](
        x, weight, weight if bias is None else bias, out, out if partial is None else partial,
        out if counters is None else counters, num_tokens, num_rows, x.stride(0),
        out.stride(0), K=k, BM=tiles.rows, BK=tiles.block_k, T_PAD=t_pad,
        HAS_BIAS=bias is not None, OUT_FP32=out_dtype == torch.float32, PDL=pdl,
        NUM_STAGES=tiles.num_stages, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        SPLIT_K=split, num_warps=tiles.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out
