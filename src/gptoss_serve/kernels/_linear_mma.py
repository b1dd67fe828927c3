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
# ruff: noqa: N803, PLR0917
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
    x_ptr, weight_ptr, bias_ptr, out_ptr, num_tokens, num_rows, stride_x, stride_out,
    K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, T_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, PDL: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[m, n0:n0 + BM] = x[m] @ W[n0:n0 + BM]^T (+ b) for every token m < num_tokens."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_mask = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # the last program's extra rows re-read a real row
    tokens = tl.arange(0, T_PAD)
    token_mask = tokens < num_tokens
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    acc = tl.zeros([BM, T_PAD], tl.float32)
    w_ptrs = weight_ptr + rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    x_ptrs = x_ptr + tokens[None, :] * stride_x + tl.arange(0, BK)[:, None]
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        k_mask = (k0 + tl.arange(0, BK)) < K
        w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)  # [BM, BK]
        x = tl.load(x_ptrs + k0, mask=k_mask[:, None] & token_mask[None, :], other=0.0)
        acc = _dot(w, x, acc, INTERPRET)  # [BM, T_PAD]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    out = out_ptr + tokens[None, :] * stride_out + rows[:, None]
    mask = row_mask[:, None] & token_mask[None, :]
    if OUT_FP32:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, _to_bf16(acc, INTERPRET), mask=mask)


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
    launcher(_linear_mma_kernel)[(triton.cdiv(num_rows, tiles.rows),)](
        x, weight, weight if bias is None else bias, out, num_tokens, num_rows, x.stride(0),
        out.stride(0), K=k, BM=tiles.rows, BK=tiles.block_k,
        T_PAD=max(16, triton.next_power_of_2(num_tokens)), HAS_BIAS=bias is not None,
        OUT_FP32=out_dtype == torch.float32, PDL=pdl, NUM_STAGES=tiles.num_stages,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=tiles.num_warps,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
