"""Triton pieces shared by the paged decode and prefill attention kernels.

Scores are kept in the log2 domain (``qk_scale`` = scale · log2 e, sinks multiplied by log2 e)
so every exponential is one ``exp2``. Row maxima start finite (the sink, or ``NO_SCORE``),
never -inf, so a row whose keys are all masked in one tile cannot produce ``-inf - -inf``.
"""

# Triton convention: compile-time constants are UPPER_CASE parameters, and kernels (and
# the launchers that mirror them) take their tensors and strides positionally.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import triton
import triton.language as tl

from gptoss_serve.kernels.kv_dtype import FP8_MAX

LOG2E_FLOAT = 1.4426950408889634  # for the host: qk_scale = scale * LOG2E_FLOAT
# Globals a @triton.jit body reads must be constexpr objects.
LOG2E = tl.constexpr(LOG2E_FLOAT)
NO_SCORE = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp2(NO_SCORE - x) == 0
E4M3_MAX = tl.constexpr(FP8_MAX)  # an FP8 cache's saturation bound


@triton.jit
def key_row_offsets(table_row, keys, key_mask, stride_cb, stride_ct, PAGE_SIZE: tl.constexpr):
    """Element offsets [N] (int64) of key positions ``keys`` [N] in a paged cache.

    table_row points at this sequence's block-table row; masked keys never load their table
    entry (it may be -1 or garbage), and their offset is the harmless 0 + (key % PAGE_SIZE).
    """
    if key_mask is None:
        pages = tl.load(table_row + keys // PAGE_SIZE)
    else:
        pages = tl.load(table_row + keys // PAGE_SIZE, mask=key_mask, other=0)
    return pages.to(tl.int64) * stride_cb + (keys % PAGE_SIZE) * stride_ct


@triton.jit
def load_rows(base, offsets, dims, row_mask):
    """Gather [N, D] rows at base + offsets[n] + dims[d]; masked rows read nothing (zeros).
    An FP8 cache's rows come back as bf16 (exact; kernels/kv_dtype.py)."""
    ptrs = base + offsets[:, None] + dims[None, :]
    if row_mask is None:  # noqa: SIM108  (a constexpr branch: Triton specialises it away)
        rows = tl.load(ptrs)
    else:
        rows = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    if base.dtype.element_ty == tl.float8e4nv:
        rows = rows.to(tl.bfloat16)
    return rows


@triton.jit
def to_cache(values, cache_ptr):
    """fp32 or bf16 values as the cache at ``cache_ptr`` stores them: the bf16 the model
    computes, then for an FP8 cache saturated to ±448 and rounded to nearest-even E4M3
    (kernels/kv_dtype.py's ``to_cache``)."""
    cache_type = cache_ptr.dtype.element_ty
    if cache_type == tl.float8e4nv:
        rounded = values.to(tl.bfloat16).to(tl.float32)
        return tl.clamp(rounded, -E4M3_MAX, E4M3_MAX).to(cache_type)
    return values.to(cache_type)


@triton.jit
def softmax_update(scores, v, m_i, l_i, acc):
    """One online-softmax step (flash attention).

    scores [M, N] fp32 log2-domain (masked entries -inf); v [N, D] bf16; running max m_i [M],
    running sum l_i [M], unnormalised output acc [M, D] fp32. P is rounded to v's dtype for the
    tensor-core product, as in every flash kernel (relative error 2^-9 per weight).
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc
