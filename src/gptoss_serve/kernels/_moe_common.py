"""Triton helpers shared by the MoE kernels (and some others), with the workarounds the
interpreter needs.

Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU test path) multiplies bf16 operands of
tl.dot as raw 16-bit integers and truncates fp32 -> bf16 casts, where the GPU rounds to
nearest even. With INTERPRET set, these helpers compute what the GPU computes instead; on the
GPU (INTERPRET false, a constexpr) they compile to the plain operation.
"""

# Triton's conventions: UPPER_CASE constexpr parameters.
# ruff: noqa: N803
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b with fp32 accumulation (bf16 operands widened exactly under INTERPRET)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16, rounding to nearest even (finite inputs)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _num_valid(valid_rows_ptr, num_entries, PER_ROW: tl.constexpr = 1):
    """How many of a call's ``num_entries`` leading entries (PER_ROW per row: 1 for tokens,
    top-k for pairs) belong to valid rows: valid_rows[0] · PER_ROW, capped at num_entries; all
    of them when ``valid_rows_ptr`` is None. Rows past the count are padding (a CUDA graph's
    rows past the step's real ones): the MoE leaves their pairs out and zeroes their output.
    The count is read here, on the device, so that a captured graph sees each replay's."""
    count = num_entries
    if valid_rows_ptr is not None:
        count = tl.minimum(tl.load(valid_rows_ptr) * PER_ROW, num_entries)
    return count


@triton.jit
def _prefetch_line(ptrs, mask):
    """prefetch.global.L2 of the line holding each pointer (where ``mask``)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p prefetch.global.L2 [$1]; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
