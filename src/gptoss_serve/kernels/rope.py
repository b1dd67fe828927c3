"""Rotary position embedding, NeoX style: the head is split in two halves, not interleaved."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, head_dim/2] in float32, scaled by YaRN's concentration."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos() * scaling, angles.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim/2]. Returns x rotated, in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)
