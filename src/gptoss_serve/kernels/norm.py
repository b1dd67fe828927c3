"""RMSNorm (gpt-oss: eps from config, weight multiplied after normalising, in float32)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., hidden] -> [..., hidden] in x's dtype; the statistics are taken in float32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
