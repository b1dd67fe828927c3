"""Triton body of ``rope.qkv_rope_and_cache_write`` from 3 to ``rope.QKV_MMA_MAX_TOKENS``
tokens: the q/k/v product on the tensor cores with the RoPE and the paged K/V write in its
epilogue, so those steps have no separate RoPE launch either (``_qkv_rope.py`` is the GEMV's
version, for 1-2 tokens).

It is ``_linear_mma._linear_mma_kernel`` (weight rows as the MMA's left operand, streamed over
K through a NUM_STAGES-deep software pipeline, the tokens as its columns) whose program owns
whole heads: 2·BP contiguous rows, BP NeoX pairs. A head of 64 rows is one wgmma of M = 64
(two 32-row products, one per half of the pairs, compiled to mma.sync and lost 0.6% of the
whole step at batch 8: bench/RESULTS.md v24). The sums plus the bias are rounded to bf16 (the
value the unfused projection stores), the halves of each head paired in registers (reshape,
permute, split) and sent through ``_qkv_rope._rotate_and_store``. ``_qkv_rope.qkv_rope_triton``
launches it, given MmaTiles.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_common import _dot, _to_bf16
from gptoss_serve.kernels._qkv_rope import _rotate_and_store, _token_angles


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
    """BP / HALF whole heads (2·BP contiguous rows), every token m < num_tokens (≤ T_PAD).
    PDL as in _qkv_rope._qkv_rope_kernel: the decode attention may launch at once."""
    if PDL:
        gdc_launch_dependents()
    HEADS: tl.constexpr = BP // HALF  # a program's heads
    NUM_ROWS: tl.constexpr = (A + 2 * KV) * 2 * HALF
    rows = tl.program_id(0) * 2 * BP + tl.arange(0, 2 * BP)
    rows = tl.minimum(rows, NUM_ROWS - 1)  # the last program's extra rows re-read a real row
    bias = tl.load(bias_ptr + rows).to(tl.float32)
    pairs = tl.program_id(0) * BP + tl.arange(0, BP)
    pair_mask = pairs < NUM_ROWS // 2
    head, d = pairs // HALF, pairs % HALF  # [BP]
    tokens = tl.arange(0, T_PAD)
    if PDL:
        gdc_wait()  # x, positions and slots come from earlier kernels or uploads
    cos, sin, slot = _token_angles(positions_ptr, cos_sin_ptr, slot_mapping_ptr, tokens,
                                   num_tokens, num_positions, d, HALF)  # fmt: skip
    acc = tl.zeros([2 * BP, T_PAD], tl.float32)
    w_ptrs = weight_ptr + rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    x_ptrs = x_ptr + tokens[None, :] * stride_x + tl.arange(0, BK)[:, None]
    token_mask = tokens < num_tokens
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        k_mask = (k0 + tl.arange(0, BK)) < K
        w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)  # [2·BP, BK]
        x = tl.load(x_ptrs + k0, mask=k_mask[:, None] & token_mask[None, :], other=0.0)
        acc = _dot(w, x, acc, INTERPRET)  # [2·BP, T_PAD]
    # what the unfused projection would have stored; row h·2·HALF + s·HALF + d is pair
    # h·HALF + d's first (s = 0) or second (s = 1) value: to [T_PAD, BP] each for the epilogue
    y = _to_bf16(acc + bias[:, None], INTERPRET).to(tl.float32)
    y = tl.permute(tl.reshape(y, [HEADS, 2, HALF, T_PAD]), [3, 0, 2, 1])
    first, second = tl.split(tl.reshape(y, [T_PAD, BP, 2]))
    _rotate_and_store(
        first, second, cos, sin, slot, tokens, token_mask, head, d, pair_mask,
        q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qo_token, stride_qo_head, stride_kc_block,
        stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
        block_size, A, KV, HALF,
    )  # fmt: skip
