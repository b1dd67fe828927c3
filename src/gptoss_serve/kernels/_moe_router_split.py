"""Triton kernels of the decode path's router for 17-384 tokens: the router GEMM split over K.

The decode router (_moe_decode._router_kernel) holds every token in each of its 128 programs,
which is right for a few tokens and slow past 16 (48.8 us at 64 tokens on the H200); the
prefill router (_moe_routing._router_topk_kernel) runs the whole K = 2880 in one program per
32 tokens, a chain of 45 dependent steps (~28 us at any decode size). Here:

1. ``_router_split_kernel``: program (token block, K part) multiplies BLOCK_T tokens by the
   128 experts' router rows over its SPLIT_K columns (tl.dot, fp32 accumulate) into
   ``partial`` [parts, T, E] fp32, and writes those columns of x in thread order (_moe_gemv.py)
   or a tile order (TILE_ORDER: _moe_gemv.ORDER_*) for the expert GEMVs.
2. ``_router_finish_kernel``: per BLOCK_T tokens, the parts summed in part order (the same
   order every run: deterministic) plus the bias, then top-k and the softmax over the k.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, PLR0917
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_columns import _tile_order_step
from gptoss_serve.kernels._moe_common import _dot
from gptoss_serve.kernels._moe_decode import _thread_order
from gptoss_serve.kernels._moe_routing import _write_routing


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _router_split_kernel(
    x_ptr, weight_ptr, partial_ptr, x_thread_ptr, num_tokens, stride_x,
    H: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
    TILE_ORDER: tl.constexpr, X_STRIDE: tl.constexpr,
):  # fmt: skip
    """partial[part, tokens, :] = x[tokens, part's columns] @ Wr[:, part's columns]^T. x is
    copied (rows X_STRIDE apart) in thread order, or with TILE_ORDER in the GEMV tile's column
    order (whole steps of 128: BLOCK_K and SPLIT_K multiples of 128; the padding past H is
    written as zeros)."""
    if PDL:  # x comes from the previous kernel
        gdc_wait()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    part = tl.program_id(1)
    experts = tl.arange(0, E_PAD)
    token_mask = tokens < num_tokens
    acc = tl.zeros([BLOCK_T, E_PAD], tl.float32)
    for k0 in tl.static_range(0, SPLIT_K, BLOCK_K):
        ks = part * SPLIT_K + k0 + tl.arange(0, BLOCK_K)
        x_mask = token_mask[:, None] & (ks < H)[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=x_mask, other=0.0)
        w_mask = (experts < E)[:, None] & (ks < H)[None, :]
        w = tl.load(weight_ptr + experts[:, None] * H + ks[None, :], mask=w_mask, other=0.0)
        acc = _dot(x, tl.trans(w), acc, INTERPRET)
        if TILE_ORDER:  # BLOCK_K = 128 from a multiple of 128: one whole step, contiguous
            in_row = ks < 128 * ((H + 127) // 128)  # the last part may reach past the padding
            tl.store(x_thread_ptr + tokens[:, None] * X_STRIDE + ks[None, :],
                     _tile_order_step(x, TILE_ORDER),
                     mask=token_mask[:, None] & in_row[None, :])  # fmt: skip
        else:
            tl.store(x_thread_ptr + tokens[:, None] * X_STRIDE + ks[None, :],
                     _thread_order(x, BLOCK_K),
                     mask=x_mask)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    rows = (part * num_tokens + tokens)[:, None] * E + experts[None, :]
    tl.store(partial_ptr + rows, acc, mask=token_mask[:, None] & (experts < E)[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _router_finish_kernel(
    partial_ptr, bias_ptr, expert_ids_ptr, routing_weights_ptr, num_tokens,
    NUM_PARTS: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ids/weights [T, k] of BLOCK_T tokens: Σ_parts partial (in part order) + bias, top-k."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (experts < E)[None, :]
    logits = tl.zeros([BLOCK_T, E_PAD], tl.float32)
    for part in tl.static_range(NUM_PARTS):
        rows = (part * num_tokens + tokens)[:, None] * E + experts[None, :]
        logits += tl.load(partial_ptr + rows, mask=mask, other=0.0)
    bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
    logits = tl.where((experts < E)[None, :], logits + bias[None, :], float("-inf"))
    _write_routing(expert_ids_ptr, routing_weights_ptr, logits, tokens, token_mask, TOP_K, K_PAD)
