"""Triton body of ``rope_and_cache_write``: one program per token.

The program computes its token's cos/sin once ([D/2] lanes), rotates all query heads into the
output, and, unless the token's slot is -1, rotates the key heads and copies the value heads
straight into the paged cache, so rotated keys never make a round trip through memory.
"""

# Triton kernels: constexpr parameters are UPPER_CASE and launch arguments are positional.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._attention_common import to_cache
from gptoss_serve.kernels.fast_launch import launcher


@triton.jit
def _rotate_heads(
    src_ptr, src_stride_head, dst_ptr, dst_stride_head, cos, sin, num_heads, half,
    HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
):  # fmt: skip
    """NeoX rotation of [num_heads, 2·half] at src into dst (dtype of dst); cos/sin [HALF]."""
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = src_ptr + heads * src_stride_head + dims
    first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    dst = dst_ptr + heads * dst_stride_head + dims
    tl.store(dst, to_cache(first * cos - second * sin, dst_ptr), mask=mask)
    tl.store(dst + half, to_cache(second * cos + first * sin, dst_ptr), mask=mask)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, scaling,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_qo_token, stride_qo_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    block_size, num_q_heads, num_kv_heads, half,
    Q_HEADS_BLOCK: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_BLOCK)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0)
    if PDL:  # inv_freq is a weight; everything else may come from the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    # Same float32 product as the reference: positions.float() * inv_freq.
    angles = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    # Angles reach 131072 rad: the approximate MUFU.COS would be far off there. Triton 3.6
    # lowers tl.cos/tl.sin to libdevice's __nv_cosf/__nv_sinf (full range reduction, as torch's
    # CUDA cos/sin), checked in the sm_90 SASS: no MUFU.COS/SIN.
    cos, sin = tl.cos(angles) * scaling, tl.sin(angles) * scaling
    _rotate_heads(
        q_ptr + token * stride_q_token, stride_q_head,
        q_out_ptr + token * stride_qo_token, stride_qo_head,
        cos, sin, num_q_heads, half, Q_HEADS_BLOCK, HALF_BLOCK,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padded token of a CUDA-graph batch, nothing to cache
        block, offset = slot // block_size, slot % block_size
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
        _rotate_heads(
            k_ptr + token * stride_k_token, stride_k_head, k_dst, stride_kc_head,
            cos, sin, num_kv_heads, half, KV_HEADS_BLOCK, HALF_BLOCK,
        )  # fmt: skip
        heads = tl.arange(0, KV_HEADS_BLOCK)[:, None]
        cols = tl.arange(0, 2 * HALF_BLOCK)[None, :]
        mask = (heads < num_kv_heads) & (cols < 2 * half)
        v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + cols, mask=mask)
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
        tl.store(v_dst + heads * stride_vc_head + cols, to_cache(v, v_dst), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_and_cache_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Launches the kernel; same contract as ``rope.rope_and_cache_write``. ``out`` [T, A, D]
    (head_dim contiguous; q itself works) receives the rotated q instead of a fresh tensor;
    ``pdl``: a programmatic dependent launch (kernels/launch.py)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    q_out = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    if q_out.stride(-1) != 1:
        raise ValueError("the output must be contiguous along head_dim")
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    launcher(_rope_cache_kernel)[(num_tokens,)](
        q, k, v, positions, inv_freq.float().contiguous(), q_out, k_cache, v_cache,
        slot_mapping, float(scaling),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_q_heads, num_kv_heads, half,
        Q_HEADS_BLOCK=triton.next_power_of_2(num_q_heads),
        KV_HEADS_BLOCK=triton.next_power_of_2(num_kv_heads),
        HALF_BLOCK=triton.next_power_of_2(half),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return q_out
