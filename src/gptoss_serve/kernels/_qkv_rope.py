"""Triton body of ``rope.qkv_rope_and_cache_write``: the q/k/v GEMV of a decode step with the
RoPE and the paged K/V write in its epilogue, so the step has no separate RoPE launch.

It is ``_linear._gemv_kernel`` (whole weight rows per program, all of their bytes in flight
at once, the weights loaded before the PDL wait) with the rows dealt in NeoX pairs: a program
owns BP pairs (d, d + D/2) of the q, k and v heads (qkv rows ``head·D + d`` and ``head·D + d
+ D/2``), which is what one rotation needs. It rounds the dot products to bf16 (the value
the unfused GEMV stores), rotates q and k pairs in fp32 with the tokens' cos/sin read from a
table made once at load (``rope.rope_cos_sin_table``: libdevice cos/sin in every program
cost more than the launch saved), and stores q rows into the output, k and v rows into the
cache at the token's slot (-1: no cache write). On the H200 its outputs were bit for bit
those of ``linear`` followed by ``rope_and_cache_write`` (bench/RESULTS.md v8).
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._attention_common import to_cache
from gptoss_serve.kernels._moe_common import _to_bf16
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.linear import GemvTiles, MmaTiles
from gptoss_serve.kernels.rope import whole_heads


@triton.jit
def _qkv_rope_kernel(
    x_ptr, weight_ptr, bias_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, num_tokens, num_positions, stride_x,
    stride_qo_token, stride_qo_head, stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head, block_size,
    A: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, T_PAD: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """BP NeoX pairs of the (A + 2·KV) heads' rows, every token m < num_tokens (≤ T_PAD).

    PDL: the next kernel (decode attention) may launch as this one's programs start. Its
    programs then read the lengths and block tables and ask L2 for their first K/V tile while
    this kernel runs (_attention_decode._decode_kernel's PREFETCH). Alone, the early trigger
    lost (v8; again in v17: the waiting programs only sit beside this stream); with the
    prefetch on, it took the whole 120b step on the H100 from 2.73 to 2.68 ms at batch 1 and
    8k context, 3.66 to 3.61 ms at batch 2 (bench/RESULTS.md v17)."""
    if PDL:
        gdc_launch_dependents()
    NUM_PAIRS: tl.constexpr = (A + 2 * KV) * HALF
    pairs = tl.program_id(0) * BP + tl.arange(0, BP)
    pair_mask = pairs < NUM_PAIRS
    pairs = tl.minimum(pairs, NUM_PAIRS - 1)  # the last program's extra pairs re-read real rows
    head, d = pairs // HALF, pairs % HALF  # [BP]
    # Tile row (j, s): row d (s = 0) or d + HALF (s = 1) of pair j's head.
    rows = tl.reshape((head * 2 * HALF + d)[:, None] + HALF * tl.arange(0, 2)[None, :], [2 * BP])
    ks = tl.arange(0, K_PAD)
    bias = tl.load(bias_ptr + rows).to(tl.float32)  # issued first, as in _gemv_kernel
    w = tl.load(weight_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                mask=(ks < K)[None, :], other=0.0)  # fmt: skip
    if PDL:
        gdc_wait()  # x, positions and slots come from earlier kernels or uploads
    tokens = tl.arange(0, T_PAD)
    cos, sin, slot = _token_angles(positions_ptr, cos_sin_ptr, slot_mapping_ptr, tokens,
                                   num_tokens, num_positions, d, HALF)  # fmt: skip
    w = w.to(tl.float32)  # [2·BP, K_PAD], once for all tokens
    y = tl.zeros([T_PAD, 2 * BP], tl.float32)
    for m in tl.static_range(T_PAD):
        x = tl.load(x_ptr + m * stride_x + ks, mask=(ks < K) & (m < num_tokens), other=0.0)
        y_m = tl.sum(w * x.to(tl.float32)[None, :], axis=1) + bias  # [2·BP]
        y = tl.where(tokens[:, None] == m, y_m[None, :], y)
    y = _to_bf16(y, INTERPRET).to(tl.float32)  # what the unfused GEMV would have stored
    first, second = tl.split(tl.reshape(y, [T_PAD, BP, 2]))  # [T_PAD, BP] each
    _rotate_and_store(
        first, second, cos, sin, slot, tokens, tokens < num_tokens, head, d, pair_mask,
        q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qo_token, stride_qo_head, stride_kc_block,
        stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
        block_size, A, KV, HALF,
    )  # fmt: skip


@triton.jit
def _token_angles(positions_ptr, cos_sin_ptr, slot_mapping_ptr, tokens, num_tokens,
                  num_positions, d, HALF: tl.constexpr):  # fmt: skip
    """cos, sin [T_PAD, BP] of the tokens' positions (clamped to the table) at frequencies
    ``d``, and each token's cache slot (-1 past num_tokens). Every token's at once, so that
    their loads overlap the dot products instead of lengthening each token's epilogue."""
    token_ok = tokens < num_tokens
    position = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
    position = tl.minimum(tl.maximum(position, 0), num_positions - 1).to(tl.int64)
    angle_ptrs = cos_sin_ptr + position[:, None] * (2 * HALF) + d[None, :]  # [T_PAD, BP]
    cos, sin = tl.load(angle_ptrs), tl.load(angle_ptrs + HALF)
    slot = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    return cos, sin, slot


@triton.jit
def _rotate_and_store(
    first, second, cos, sin, slot, tokens, token_ok, head, d, pair_mask,
    q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qo_token, stride_qo_head, stride_kc_block,
    stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    block_size, A: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """The epilogue of both fused kernels: rows d (``first``) and d + HALF (``second``) of
    each pair's head, [T_PAD, BP] bf16-rounded values in fp32, rotated in fp32; q rows to the
    output, k (rotated) and v rows to the cache at the token's slot (-1: a padded token of a
    CUDA-graph batch, nothing cached)."""
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    is_q = (pair_mask & (head < A))[None, :] & token_ok[:, None]
    cached = (token_ok & (slot >= 0))[:, None]
    is_k = (pair_mask & (head >= A) & (head < A + KV))[None, :] & cached
    is_v = (pair_mask & (head >= A + KV))[None, :] & cached
    q_ptrs = q_out_ptr + tokens[:, None] * stride_qo_token
    q_ptrs += (tl.minimum(head, A - 1) * stride_qo_head + d)[None, :]
    q_type = q_out_ptr.dtype.element_ty
    tl.store(q_ptrs, rotated_first.to(q_type), mask=is_q)
    tl.store(q_ptrs + HALF, rotated_second.to(q_type), mask=is_q)
    block, offset = tl.maximum(slot, 0) // block_size, tl.maximum(slot, 0) % block_size
    k_ptrs = k_cache_ptr + (block * stride_kc_block + offset * stride_kc_slot)[:, None]
    k_ptrs += (tl.minimum(tl.maximum(head - A, 0), KV - 1) * stride_kc_head + d)[None, :]
    tl.store(k_ptrs, to_cache(rotated_first, k_cache_ptr), mask=is_k)
    tl.store(k_ptrs + HALF, to_cache(rotated_second, k_cache_ptr), mask=is_k)
    v_ptrs = v_cache_ptr + (block * stride_vc_block + offset * stride_vc_slot)[:, None]
    v_ptrs += (tl.minimum(tl.maximum(head - A - KV, 0), KV - 1) * stride_vc_head + d)[None, :]
    tl.store(v_ptrs, to_cache(first, v_cache_ptr), mask=is_v)
    tl.store(v_ptrs + HALF, to_cache(second, v_cache_ptr), mask=is_v)


def qkv_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    tiles: GemvTiles | MmaTiles,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Launches a fused kernel: with GemvTiles this module's GEMV, with MmaTiles the
    tensor-core one of ``_qkv_rope_mma.py`` (``tiles.rows`` weight rows, whole heads, a
    program; at most 256 tokens). Contract of ``rope.qkv_rope_and_cache_write`` with its
    cos/sin table ``cos_sin`` [P, D] float32 (``rope.rope_cos_sin_table``; positions are
    clamped to it). ``out`` [T, A, D] (head_dim contiguous) receives q instead of a fresh
    tensor."""
    num_tokens, k = x.shape
    head_dim = k_cache.shape[-1]
    on_mma = isinstance(tiles, MmaTiles)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    if tiles.rows % 2:
        raise ValueError(f"the fused kernels deal rows in pairs, got {tiles.rows} rows")
    if on_mma and not whole_heads(tiles, head_dim):
        raise ValueError(f"the tensor-core kernel takes whole heads of a power-of-two size "
                         f"({head_dim} rows), got {tiles.rows} rows")  # fmt: skip
    if on_mma and num_tokens > 256:
        raise ValueError(f"the MMA's token columns are at most 256, got {num_tokens} tokens")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be [positions, {head_dim}] float32, got {cos_sin.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q_out = out if out is not None else x.new_empty(num_tokens, num_heads, head_dim)
    if q_out.stride(-1) != 1:
        raise ValueError("the output must be contiguous along head_dim")
    if num_tokens == 0:
        return q_out
    if on_mma:
        # Imported here: that module builds on this one's epilogue.
        from gptoss_serve.kernels._qkv_rope_mma import _qkv_rope_mma_kernel  # noqa: PLC0415

        kernel = _qkv_rope_mma_kernel
        own = dict(BK=tiles.block_k, NUM_STAGES=tiles.num_stages,
                   T_PAD=max(16, triton.next_power_of_2(num_tokens)))  # fmt: skip
    else:
        kernel = _qkv_rope_kernel
        own = dict(K_PAD=triton.next_power_of_2(k), T_PAD=triton.next_power_of_2(num_tokens))
    half = head_dim // 2
    pairs_per_program = tiles.rows // 2
    num_pairs = (num_heads + 2 * num_kv_heads) * half
    launcher(kernel)[(triton.cdiv(num_pairs, pairs_per_program),)](
        x, weight.contiguous(), bias, positions, cos_sin.contiguous(), slot_mapping,
        q_out, k_cache, v_cache, num_tokens, cos_sin.shape[0], x.stride(0),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[1],
        A=num_heads, KV=num_kv_heads, HALF=half, K=k, BP=pairs_per_program, PDL=pdl,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=tiles.num_warps,
        launch_pdl=pdl, **own,
    )  # fmt: skip
    return q_out
