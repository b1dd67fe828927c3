"""Triton body of ``rope.qkv_rope_and_cache_write`` for the tokens the tensor-core projection
serves (``linear.mma_applies``: 3 to ``linear.MMA_MAX_TOKENS``): the q/k/v product on the
tensor cores with the RoPE and the paged K/V write in its epilogue, so those steps have no
separate RoPE launch either (``_qkv_rope.py`` is the GEMV's version, for 1-2 tokens).

It is ``_linear_mma._linear_mma_kernel`` (weight rows as the MMA's left operand, streamed over
K through a NUM_STAGES-deep software pipeline, the tokens as its columns) with the rows dealt
in NeoX pairs: a program owns BP pairs (d, d + D/2) of the q, k and v heads and runs two
products, rows d and rows d + D/2, whose [BP, T] accumulators line up element for element,
which is what a rotation needs. Their sums plus the bias are rounded to bf16 (the value the
unfused projection stores) and go through ``_qkv_rope._rotate_and_store``.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_common import _dot, _to_bf16
from gptoss_serve.kernels._qkv_rope import (
    _rotate_and_store,
    _token_angles,
    fused_operands,
    launch_fused,
)
from gptoss_serve.kernels.linear import MmaTiles


@triton.jit
def _qkv_rope_mma_kernel(
    x_ptr, weight_ptr, bias_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, num_tokens, num_positions, stride_x,
    stride_qo_token, stride_qo_head, stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head, block_size,
    A: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, T_PAD: tl.constexpr, BP: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """BP NeoX pairs of the (A + 2·KV) heads' rows, every token m < num_tokens (≤ T_PAD).
    PDL as in _qkv_rope._qkv_rope_kernel: the decode attention may launch at once."""
    if PDL:
        gdc_launch_dependents()
    NUM_PAIRS: tl.constexpr = (A + 2 * KV) * HALF
    pairs = tl.program_id(0) * BP + tl.arange(0, BP)
    pair_mask = pairs < NUM_PAIRS
    pairs = tl.minimum(pairs, NUM_PAIRS - 1)  # the last program's extra pairs re-read real rows
    head, d = pairs // HALF, pairs % HALF  # [BP]
    first_rows = head * 2 * HALF + d  # row d of the pair's head; row d + HALF is its partner
    bias_first = tl.load(bias_ptr + first_rows).to(tl.float32)
    bias_second = tl.load(bias_ptr + first_rows + HALF).to(tl.float32)
    tokens = tl.arange(0, T_PAD)
    if PDL:
        gdc_wait()  # x, positions and slots come from earlier kernels or uploads
    cos, sin, slot = _token_angles(positions_ptr, cos_sin_ptr, slot_mapping_ptr, tokens,
                                   num_tokens, num_positions, d, HALF)  # fmt: skip
    acc_first = tl.zeros([BP, T_PAD], tl.float32)
    acc_second = tl.zeros([BP, T_PAD], tl.float32)
    w_ptrs = weight_ptr + first_rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    x_ptrs = x_ptr + tokens[None, :] * stride_x + tl.arange(0, BK)[:, None]
    token_mask = tokens < num_tokens
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        k_mask = (k0 + tl.arange(0, BK)) < K
        w_first = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)  # [BP, BK]
        w_second = tl.load(w_ptrs + HALF * K + k0, mask=k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=k_mask[:, None] & token_mask[None, :], other=0.0)
        acc_first = _dot(w_first, x, acc_first, INTERPRET)  # [BP, T_PAD]
        acc_second = _dot(w_second, x, acc_second, INTERPRET)
    # what the unfused projection would have stored, as [T_PAD, BP] for the shared epilogue
    first = tl.trans(_to_bf16(acc_first + bias_first[:, None], INTERPRET).to(tl.float32))
    second = tl.trans(_to_bf16(acc_second + bias_second[:, None], INTERPRET).to(tl.float32))
    _rotate_and_store(
        first, second, cos, sin, slot, tokens, token_mask, head, d, pair_mask,
        q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qo_token, stride_qo_head, stride_kc_block,
        stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
        block_size, A, KV, HALF,
    )  # fmt: skip


def qkv_rope_mma_triton(
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
    tiles: MmaTiles,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """As ``_qkv_rope.qkv_rope_triton``, on the tensor cores: ``tiles.rows`` weight rows (half
    as many pairs) a program, at most 256 tokens."""
    x, q_out = fused_operands(x, k_cache, v_cache, cos_sin, tiles.rows, num_heads, out)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return q_out
    if num_tokens > 256:
        raise ValueError(f"the MMA's token columns are at most 256, got {num_tokens} tokens")
    launch_fused(
        _qkv_rope_mma_kernel, tiles.rows // 2, x, weight, bias, positions, cos_sin, k_cache,
        v_cache, slot_mapping, q_out, num_heads, num_kv_heads, pdl=pdl,
        num_warps=tiles.num_warps, BK=tiles.block_k, NUM_STAGES=tiles.num_stages,
        T_PAD=max(16, triton.next_power_of_2(num_tokens)),
    )  # fmt: skip
    return q_out
