"""Triton bodies of the in-register MXFP4 decode (OCP MX v1.0: E2M1 elements, E8M0 scales).

Weights stay MXFP4: for one expert, ``blocks`` [N, K/32, 16] uint8 (in the checkpoint, row n
holds K/2 contiguous bytes; on CUDA the engine reorders them into step rows, LB, padded to
whole steps, which ``_packed_offsets`` follows: kernels/mxfp4_layout.py; byte b of a group
holds element 2b in its low nibble, 2b+1 in its high nibble) and ``scales`` [N, K/32] uint8
(rows as far apart as their stride: padded with the blocks), value = code_value · 2^(s−127).
A tile of BN rows x BLOCK_K columns is read as [BN, BLOCK_K/32, 16] bytes (16-byte vector
loads) plus [BN, BLOCK_K/32] scales and decoded in registers; bf16 weights never exist in memory.

Two decodes with identical results (the GPU test checks both bit for bit):
- portable Triton: a nibble placed at fp16 bits 15 (sign) and 11-9 (magnitude eem) reads as
  code_value · 2^−14 (0.5 is the fp16 subnormal 2^−15); fp16 -> fp32 is exact, and one multiply
  by 2^(s−113) gives the value, exactly for 3 ≤ s ≤ 240. ~10 instructions per element in SASS.
- inline PTX (GPU only): two elements per 32-bit register and packed bf16x2 multiplies;
  ~7 per element including the layout shuffles around it. Exact for 1 ≤ s ≤ 252.
Real checkpoints' scales sit near 127.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, PLR0917
from __future__ import annotations

import triton
import triton.language as tl

from gptoss_serve.kernels._word_bits import _unpermute

# 4 packed bytes b0..b3 ($4) and their E8M0 scales s0..s3 ($5) -> 4 registers of two bf16.
# prmt spreads bytes (b0, b1) to the two 16-bit halves; a nibble moved to bf16 bits 15 (sign)
# and 8-6 (magnitude) reads as code_value · 2^−126 (0.5 is a bf16 subnormal, which mul.bf16x2
# keeps); x 2^126 (0x7E80), then x 2^(s−127) (bf16 bits s << 7): both exact.
# $0/$1: even elements of (b0, b1)/(b2, b3); $2/$3: odd elements.
_NIBBLES_PTX = """shl.b32 lo, t, {sign_shift};
shl.b32 hi, t, {magnitude_shift};
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x01C001C0;
or.b32 u, lo, hi;
mul.rn.bf16x2 u, u, bias;
mul.rn.bf16x2 {out}, u, sc;
"""


def _byte_pair_ptx(selector: str, even_out: str, odd_out: str) -> str:
    """PTX decoding the two bytes ``selector`` picks: low nibbles (even elements) at bit 3 ->
    15 and 2-0 -> 8-6 (shifts 12, 6), high nibbles at bit 7 -> 15 and 6-4 -> 8-6 (8, 2)."""
    return (
        f"prmt.b32 t, $4, 0, {selector};\n"
        f"prmt.b32 sc, $5, 0, {selector};\n"
        "shl.b32 sc, sc, 7;\n"
        + _NIBBLES_PTX.format(sign_shift=12, magnitude_shift=6, out=even_out)
        + _NIBBLES_PTX.format(sign_shift=8, magnitude_shift=2, out=odd_out)
    )


_E2M1_PTX = tl.constexpr(
    "\n{\n.reg .b32 t, u, lo, hi, sc, bias;\nmov.b32 bias, 0x7E807E80;\n"
    + _byte_pair_ptx("0x4140", "$0", "$2")  # bytes (b0, b1)
    + _byte_pair_ptx("0x4342", "$1", "$3")  # bytes (b2, b3)
    + "}\n"
)


@triton.jit
def _packed_offsets(rows, groups, K, stride_block_row, LB: tl.constexpr):
    """Byte offsets [R, C] of group ``groups`` [C] of rows ``rows`` [R] in one expert's blocks
    of K columns: rows ``stride_block_row`` apart (LB = 1), or in step-major bands of LB rows
    padded to whole steps (kernels/mxfp4_layout.py; contiguous)."""
    if LB == 1:
        return rows[:, None] * stride_block_row + groups[None, :] * 16
    band = (rows[:, None] // LB) * (LB * 16 * (4 * tl.cdiv(K // 32, 4)))
    main = (groups[None, :] // 4) * (LB * 64) + (rows[:, None] % LB) * 64
    return band + main + (groups[None, :] % 4) * 16


@triton.jit
def _load_packed(
    blocks_ptr, scales_ptr, rows, row_mask, k0, K, stride_block_row, stride_scale_row,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """(bytes [BN, BLOCK_K/32, 16], scales [BN, BLOCK_K/32]) uint8 of columns [k0, k0+BLOCK_K)
    of rows ``rows``; ``blocks_ptr``/``scales_ptr`` point at the expert; LB: the blocks' step
    rows (``_packed_offsets``). Masked parts read 0."""
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    mask = row_mask[:, None]
    if not EVEN_K:
        mask = mask & (groups < K // 32)[None, :]
    scale = tl.load(
        scales_ptr + rows[:, None] * stride_scale_row + groups[None, :], mask=mask, other=0
    )
    offsets = _packed_offsets(rows, groups, K, stride_block_row, LB)
    if LB == 1:
        byte_ptrs = blocks_ptr + offsets[:, :, None] + tl.arange(0, 16)[None, None, :]
        return tl.load(byte_ptrs, mask=mask[:, :, None], other=0), scale
    # The kernels' layout permutes each word's bits (mxfp4_layout.permute_words): restore the
    # checkpoint's, then the words' bytes (little-endian).
    word_ptrs = (blocks_ptr + offsets).to(tl.pointer_type(tl.int32))
    words = tl.load(word_ptrs[:, :, None] + tl.arange(0, 4)[None, None, :],
                    mask=mask[:, :, None], other=0)  # fmt: skip
    words = _unpermute(words.to(tl.uint32, bitcast=True))
    packed = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF
    return tl.reshape(packed.to(tl.uint8), [rows.shape[0], BLOCK_K // 32, 16]), scale


@triton.jit
def _code_values(packed):
    """Bytes [..., 16] -> fp32 (even, odd) code_value · 2^−14, by the fp16 placement above."""
    packed = packed.to(tl.int32)
    even = ((packed & 0x08) << 12) | ((packed & 0x07) << 9)  # low nibble
    odd = ((packed & 0x80) << 8) | ((packed & 0x70) << 5)  # high nibble
    even = even.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_values(scale):
    """E8M0 exponents (uint8) -> fp32 2^(s−113): the scale times the 2^14 of _code_values."""
    return ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_pairs_ptx(packed, scale):
    """Bytes and their scales (same shape, uint8) -> (even, odd) bf16 elements (GPU only)."""
    return tl.inline_asm_elementwise(
        _E2M1_PTX,
        "=r,=r,=r,=r,r,r",
        [packed, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _dequant_tile(
    blocks_ptr, scales_ptr, rows, row_mask, k0, K, stride_block_row, stride_scale_row,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """Rows ``rows`` [BN] x columns [k0, k0 + BLOCK_K) of one expert -> [BN, BLOCK_K] bf16."""
    packed, scale = _load_packed(
        blocks_ptr, scales_ptr, rows, row_mask, k0, K, stride_block_row, stride_scale_row,
        BLOCK_K, EVEN_K, LB,
    )  # fmt: skip
    if PTX:
        even, odd = _e2m1_pairs_ptx(packed, tl.broadcast_to(scale[:, :, None], packed.shape))
    else:
        even, odd = _code_values(packed)
        scale = _scale_values(scale)[:, :, None]
        even, odd = even * scale, odd * scale
    values = tl.reshape(tl.join(even, odd), [rows.shape[0], BLOCK_K])  # byte b: 2b, 2b+1
    # Portable path: bf16 only after the reshape. Converting before it crashes Triton 3.6's
    # dot-operand layout hoisting on the wgmma path ("Illegal shared layout").
    return values.to(tl.bfloat16)


@triton.jit
def _dequant_kernel(
    blocks_ptr, scales_ptr, out_ptr, N, K, stride_block_row, stride_scale_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, LB: tl.constexpr = 1,
):  # fmt: skip
    """Debug: write the in-kernel decode of [N, K/32, 16] blocks as bf16 [N, K] (tests only)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequant_tile(
        blocks_ptr, scales_ptr, rows, rows < N, k0, K, stride_block_row, stride_scale_row,
        BLOCK_K, False, PTX, LB,
    )  # fmt: skip
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (ks < K)[None, :]
    tl.store(out_ptr + rows[:, None] * K + ks[None, :], w, mask=mask)
