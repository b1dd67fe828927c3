"""YaRN inverse frequencies (Peng et al. 2023, arXiv:2309.00071) as gpt-oss configures them.

Dimensions rotating fewer than ``beta_slow`` times over the original context are interpolated
(divided by ``factor``), those rotating more than ``beta_fast`` times are kept, and a linear
ramp blends the two in between. gpt-oss sets ``truncate: false``, so the ramp's ends are not
floored/ceiled. Computed in float32, as the released model and HF transformers do.
"""

from __future__ import annotations

import math

import torch

from gptoss_serve.config import RopeConfig


def _correction_dim(num_rotations: float, dim: int, base: float, context: int) -> float:
    """The rotary dimension index that completes ``num_rotations`` turns over ``context``."""
    return dim * math.log(context / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    pos_freqs = rope.theta**exponents
    extrapolation = 1.0 / pos_freqs
    if rope.factor <= 1.0:
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)
    context = rope.original_max_position_embeddings
    low = _correction_dim(rope.beta_fast, head_dim, rope.theta, context)
    high = _correction_dim(rope.beta_slow, head_dim, rope.theta, context)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep
