"""RMSNorm (gpt-oss: eps from config, weight multiplied after normalising, in float32).

``fused_add_rms_norm`` is the transformer block's "residual += x; h = norm(residual)" in one
pass over the row: on CUDA a Triton kernel (``_norm.py``), elsewhere its torch reference.
"""

from __future__ import annotations

import torch

from gptoss_serve.kernels.launch import pdl_applies


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., hidden] -> [..., hidden] in x's dtype; the statistics are taken in float32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"expected x [T, H] and weight [H], got {tuple(x.shape)}, {weight.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.shape} {residual.dtype} does not match x")


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (normed [T, H], new_residual [T, H]), both in x's dtype.

    new_residual = x + residual (x alone for the first layer, residual None), rounded to x's
    dtype as the residual stream is stored; normed = rms_norm(new_residual, weight, eps).
    ``pdl``: a programmatic dependent launch where that applies (kernels/launch.py).
    """
    _check(x, residual, weight)
    if x.is_cuda:
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._norm import fused_add_rms_norm_triton  # noqa: PLC0415

        return fused_add_rms_norm_triton(x, residual, weight, eps, pdl=pdl_applies(pdl, x))
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the numerics the kernel is checked against."""
    new_residual = x if residual is None else x + residual
    return rms_norm(new_residual, weight, eps), new_residual.clone()
