"""MXFP4 dequantization (OCP Microscaling Formats v1.0, element type E2M1, scale type E8M0).

Layout as released in gpt-oss checkpoints: ``blocks`` [..., G, 16] uint8 holds 32 E2M1 codes
per group, two per byte, the LOW nibble being the even element; ``scales`` [..., G] uint8 holds
one E8M0 exponent per group: value = code_value · 2^(scale − 127).
"""

from __future__ import annotations

import torch

# E2M1 code -> value. Bit 3 is the sign; bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
E2M1_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
E8M0_BIAS = 127
BLOCK_SIZE = 32


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., G, 16] uint8 blocks + [..., G] uint8 scales -> [..., G * 32] values in ``dtype``.

    Exact: every E2M1 value times a power of two is representable in bf16 and fp32 (for the
    exponents a trained model uses), so the result does not depend on ``dtype``.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"expected uint8 blocks and scales, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(f"blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]  # even elements
    high = lut[(blocks >> 4).long()]  # odd elements
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)
