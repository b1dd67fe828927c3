"""The batched forward pass of gpt-oss over the paged KV cache, composed from kernels/ ops.

A pure function of the weights, the caches, one step's token ids, its AttentionMetadata and
its count of valid rows; it holds no state, so the runner can call it eagerly or inside a
CUDA-graph capture.
"""

from __future__ import annotations

import torch

from gptoss_serve.engine.attention_metadata import AttentionMetadata
from gptoss_serve.engine.kv_cache import KvCacheTensors
from gptoss_serve.engine.ops import Ops
from gptoss_serve.engine.weights import AttentionWeights, ModelWeights


def forward(
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    input_ids: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    logits_indices: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids [T] -> float32 logits [S, V] of the rows ``logits_indices`` (all if None).

    Writes this step's K/V into ``kv`` at ``metadata.slot_mapping``. ``valid_rows`` (int32 [1]
    on the device; None: all T): the rows from ``valid_rows[0]`` on are a padded decode step's
    padding, which the MoE leaves out (no expert weights read for them; their MoE output is
    zero, and their logits are never sampled).
    """
    config = weights.config
    eps = config.rms_norm_eps
    x = weights.embedding[input_ids]  # [T, H]
    residual = None
    for index, layer in enumerate(weights.layers):
        normed, residual = ops.fused_add_rms_norm(x, residual, layer.attention.input_norm, eps)
        x = _attention(weights, kv, ops, index, layer.attention, normed, metadata)
        normed, residual = ops.fused_add_rms_norm(x, residual, layer.attention.post_norm, eps)
        x = ops.moe(
            normed,
            layer.moe,
            top_k=config.num_experts_per_tok,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
            valid_rows=valid_rows,
        )
    if logits_indices is not None:
        x, residual = x[logits_indices], residual[logits_indices]
    normed, _ = ops.fused_add_rms_norm(x, residual, weights.final_norm, eps)
    return ops.linear(normed, weights.lm_head, out_dtype=torch.float32)


def _attention(  # noqa: PLR0917 (one layer's inputs)
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    index: int,
    attn: AttentionWeights,
    x: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """x [T, H] (normed) -> the attention block's output [T, H] (before the residual)."""
    config = weights.config
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    num_tokens = x.shape[0]
    group = kv.groups[index]
    k_cache, v_cache = kv.key[index], kv.value[index]
    q = ops.qkv_rope_and_cache_write(
        x,
        attn.qkv_weight,
        attn.qkv_bias,
        metadata.positions,
        weights.inv_freq,
        config.rope.attention_scaling,
        k_cache,
        v_cache,
        metadata.slot_mapping[group],
        num_heads=heads,
        num_kv_heads=kv_heads,
        cos_sin=weights.rope_cos_sin,
    )  # [T, A, D], this step's K/V in the cache
    window = config.sliding_window if config.is_sliding(index) else None
    scale = head_dim**-0.5
    out = torch.empty_like(q)  # [T, A, D]
    num_decodes = metadata.num_decodes
    if num_decodes:
        ops.attention_decode(
            q[:num_decodes],
            k_cache,
            v_cache,
            metadata.decode_block_tables[group],
            metadata.decode_seq_lens,
            attn.sinks,
            window=window,
            scale=scale,
            max_seq_len=metadata.decode_max_seq_len,
            out=out[:num_decodes],
        )
    if num_tokens > num_decodes:
        ops.attention_prefill(
            q[num_decodes:],
            k_cache,
            v_cache,
            metadata.prefill_block_tables[group],
            metadata.prefill_query_start_loc,
            metadata.prefill_seq_lens,
            attn.sinks,
            window=window,
            scale=scale,
            out=out[num_decodes:],
        )
    return ops.linear(out.view(num_tokens, config.q_dim), attn.o_weight, attn.o_bias)
