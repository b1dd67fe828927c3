"""Triton bodies of the L2 prefetch (``prefetch.py``): bulk ``cp.async.bulk.prefetch.L2``
requests, one per thread, each for CHUNK bytes; the copy engine fetches them while the
issuing program has long exited."""

# Triton's conventions: UPPER_CASE constexpr parameters.
# ruff: noqa: N803, PLR0917
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bulk_prefetch(ptrs, nbytes):
    """Ask L2 to fetch ``nbytes`` (int32, a multiple of 16; 0: nothing) from each pointer."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; mov.u32 $0, 0;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; }",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(
    base_ptr, ids_ptr, nbytes, stride, CHUNK: tl.constexpr, THREADS: tl.constexpr,
    INDEXED: tl.constexpr,
):  # fmt: skip
    """Bytes [0, nbytes) from ``base_ptr`` (u8), or with INDEXED from base + ids[axis 1] ·
    stride; program (c, i) covers chunks [c·THREADS, (c+1)·THREADS) of that range."""
    start = base_ptr
    if INDEXED:
        start += tl.load(ids_ptr + tl.program_id(1)).to(tl.int64) * stride
    offsets = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
    sizes = tl.minimum(nbytes - offsets, CHUNK) & ~15  # the last chunk's tail is dropped
    _bulk_prefetch(start + offsets, sizes.to(tl.int32))
