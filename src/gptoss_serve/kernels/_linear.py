"""Triton body of the dense bf16 GEMV (``linear.py``): a few tokens times a row-major weight.

Decode multiplies 1 to a few activation rows by each projection (q/k/v, o, the unembedding),
so the time is the weight read. cuBLAS picks GEMM tiles that leave most of the SMs' load
slots empty at these shapes; here every program owns BN whole weight rows and reads all of
their K columns with one vectorised load, so each thread has all its bytes in flight at once
and the program's life is one trip to HBM plus the arithmetic (no loop-carried latency
chain). K is padded to a power of two for the tile (2880 -> 4096: the masked lanes cost
registers and issue slots, never bytes). The fp32 dot product of each row is a tree
reduction over the row's lanes, then bias, then one store per token.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, PLR0917
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_common import _to_bf16
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.linear import GemvTiles


@triton.jit
def _gemv_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, num_tokens, num_rows, stride_x, stride_out,
    K: tl.constexpr, K_PAD: tl.constexpr, T_PAD: tl.constexpr, BN: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out[m, n0:n0 + BN] = x[m] @ W[n0:n0 + BN]^T (+ b) for every token m < num_tokens (at most
    T_PAD, a power of two: one compiled variant per bucket), fp32 accumulation.

    Tried and dropped: the block's residual add + RMSNorm recomputed in every program in front
    of the q/k/v GEMV (no norm launch) cost more than the launch it saved (H200, 36 layers:
    417 us against 60 + 350).

    PDL (programmatic dependent launch): the weights and bias, which no earlier kernel
    writes, are loaded before waiting for the previous kernel (whose tail they overlap).
    """
    if PDL:  # let the next kernel's programs in as this one's last ones start
        gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # the last program's extra rows re-read a real row
    ks = tl.arange(0, K_PAD)
    if HAS_BIAS:  # issued first: a load after the weights' would be a second trip to memory
        bias = tl.load(bias_ptr + rows).to(tl.float32)
    w_ptrs = weight_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    w = tl.load(w_ptrs, mask=(ks < K)[None, :], other=0.0)  # all-true mask when K_PAD == K
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    w = w.to(tl.float32)  # [BN, K_PAD], once for all tokens
    for m in tl.static_range(T_PAD):
        in_row = (ks < K) & (m < num_tokens)
        x = tl.load(x_ptr + m * stride_x + ks, mask=in_row, other=0.0)
        y = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BN]
        if HAS_BIAS:
            y += bias
        out = out_ptr + m * stride_out + rows
        if OUT_FP32:
            tl.store(out, y, mask=row_mask & (m < num_tokens))
        else:
            tl.store(out, _to_bf16(y, INTERPRET), mask=row_mask & (m < num_tokens))


def dense_operands(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x with unit stride along K, the weight contiguous, a fresh [T, N] output) for the
    dense kernels' launchers."""
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    return x, weight.contiguous(), out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: GemvTiles,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Launch the GEMV: x [T, K] (unit stride along K), weight [N, K] -> [T, N] out_dtype;
    ``pdl``: as a programmatic dependent launch (kernels/launch.py)."""
    x, weight, out = dense_operands(x, weight, out_dtype)
    num_tokens, k = x.shape
    num_rows = weight.shape[0]
    if num_tokens == 0:
        return out
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    launcher(_gemv_kernel)[(triton.cdiv(num_rows, tiles.rows),)](
        x, weight, weight if bias is None else bias, out, num_tokens, num_rows, x.stride(0),
        out.stride(0), K=k, K_PAD=triton.next_power_of_2(k),
        T_PAD=triton.next_power_of_2(num_tokens), BN=tiles.rows, HAS_BIAS=bias is not None,
        OUT_FP32=out_dtype == torch.float32, PDL=pdl, INTERPRET=interpreting,
        num_warps=tiles.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out
