"""Triton body of ``fused_add_rms_norm``: one program per token row, the whole row in registers.

hidden = 2880 is not a power of two, so the row is one masked block of ``next_power_of_2``
(4096) lanes; the masked lanes load 0 and add nothing to the sum of squares.
"""

# Triton kernels: constexpr parameters are UPPER_CASE and launch arguments are positional.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels.fast_launch import launcher

# Warps of a program whose row block has 2048+ lanes (4 below: one warp holds 32 of them a
# register each). hidden = 2880 takes 4096-lane blocks, 16 lanes a thread on 8 warps.
WIDE_ROW_WARPS = 8


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], unused without HAS_RESIDUAL
    weight_ptr,  # [H]
    normed_ptr,  # [T, H] out
    new_residual_ptr,  # [T, H] out
    stride_x,
    stride_residual,
    stride_normed,
    stride_new_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if PDL:
        gdc_launch_dependents()
    # The norm weight is no earlier kernel's output: with PDL it is loaded before the wait.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = new_residual_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first: the residual stream is stored in it, and
        # the statistics must be those of the stored values (as the reference computes them).
        summed = (x + residual.to(tl.float32)).to(out_dtype)
    else:
        summed = x.to(out_dtype)
    tl.store(new_residual_ptr + row * stride_new_residual + cols, summed, mask=mask)
    summed = summed.to(tl.float32)
    mean_square = tl.sum(summed * summed, axis=0) / hidden
    normed = summed * tl.math.rsqrt(mean_square + eps) * weight
    tl.store(normed_ptr + row * stride_normed + cols, normed.to(out_dtype), mask=mask)


def fused_add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel; same contract as ``norm.fused_add_rms_norm``. ``out`` (normed,
    new_residual), row-strided [T, H] buffers, is written instead of fresh tensors: it may be
    (a view of) x or residual itself, since each program reads its row before writing it."""
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if out is None:
        normed = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
        out = (normed, torch.empty_like(normed))
    normed, new_residual = out
    if normed.stride(-1) != 1 or new_residual.stride(-1) != 1:
        raise ValueError("the outputs must be contiguous along hidden")
    if num_tokens == 0:
        return normed, new_residual
    block = triton.next_power_of_2(hidden)
    launcher(_fused_add_rms_norm_kernel)[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        normed,
        new_residual,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        normed.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=WIDE_ROW_WARPS if block >= 2048 else 4,
        launch_pdl=pdl,
    )
    return normed, new_residual
