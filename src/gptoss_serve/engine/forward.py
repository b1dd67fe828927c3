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
from gptoss_serve.engine.weights import ModelWeights


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

    The same ops in the same order as ``first_piece``, ``attend`` and ``next_piece`` layer by
    layer, then ``final_logits``: the pieces a piecewise CUDA graph captures
    (engine/piecewise_graphs.py).
    """
    q, residual = first_piece(weights, kv, ops, input_ids, metadata)
    x = None
    for index in range(len(weights.layers)):
        out = torch.empty_like(q)  # [T, A, D]
        attend(weights, kv, ops, index, q, metadata, out)
        q, x, residual = next_piece(weights, kv, ops, index, out, residual, metadata,
                                    valid_rows=valid_rows)  # fmt: skip
    return final_logits(weights, ops, x, residual, logits_indices)


def first_piece(
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    input_ids: torch.Tensor,
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding, layer 0's input norm and its q/k/v: (q [T, A, D], residual [T, H])."""
    x = weights.embedding[input_ids]  # [T, H]
    layer = weights.layers[0].attention
    normed, residual = ops.fused_add_rms_norm(
        x, None, layer.input_norm, weights.config.rms_norm_eps
    )
    return _qkv(weights, kv, ops, 0, normed, metadata), residual


def next_piece(  # noqa: PLR0917 (one layer's inputs)
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    index: int,
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    valid_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Layer ``index`` after its attention (o projection, residual add and norm, MoE) and the
    next layer's input norm and q/k/v: (q [T, A, D] or None after the last layer, the MoE's
    output x [T, H] (before its residual add), residual [T, H])."""
    config = weights.config
    eps = config.rms_norm_eps
    layer = weights.layers[index]
    attn = layer.attention
    x = ops.linear(attention_out.view(attention_out.shape[0], config.q_dim), attn.o_weight,
                   attn.o_bias)  # fmt: skip
    normed, residual = ops.fused_add_rms_norm(x, residual, attn.post_norm, eps)
    x = ops.moe(
        normed,
        layer.moe,
        top_k=config.num_experts_per_tok,
        alpha=config.swiglu_alpha,
        limit=config.swiglu_limit,
        valid_rows=valid_rows,
    )
    if index + 1 == len(weights.layers):
        return None, x, residual
    following = weights.layers[index + 1].attention
    normed, residual = ops.fused_add_rms_norm(x, residual, following.input_norm, eps)
    return _qkv(weights, kv, ops, index + 1, normed, metadata), x, residual


def final_logits(
    weights: ModelWeights,
    ops: Ops,
    x: torch.Tensor,
    residual: torch.Tensor,
    logits_indices: torch.Tensor | None,
) -> torch.Tensor:
    """The last layer's MoE output and residual -> float32 logits of the rows sampled."""
    if logits_indices is not None:
        x, residual = x[logits_indices], residual[logits_indices]
    normed, _ = ops.fused_add_rms_norm(x, residual, weights.final_norm, weights.config.rms_norm_eps)
    return ops.linear(normed, weights.lm_head, out_dtype=torch.float32)


def _qkv(  # noqa: PLR0917 (one layer's inputs)
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    index: int,
    x: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """x [T, H] (normed) -> q [T, A, D] with RoPE; this step's K/V written into the cache."""
    config = weights.config
    attn = weights.layers[index].attention
    group = kv.groups[index]
    return ops.qkv_rope_and_cache_write(
        x,
        attn.qkv_weight,
        attn.qkv_bias,
        metadata.positions,
        weights.inv_freq,
        config.rope.attention_scaling,
        kv.key[index],
        kv.value[index],
        metadata.slot_mapping[group],
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        cos_sin=weights.rope_cos_sin,
    )


def attend(  # noqa: PLR0917 (one layer's inputs)
    weights: ModelWeights,
    kv: KvCacheTensors,
    ops: Ops,
    index: int,
    q: torch.Tensor,
    metadata: AttentionMetadata,
    out: torch.Tensor,
) -> None:
    """Layer ``index``'s attention of q [T, A, D] over the cache into ``out`` [T, A, D]: the
    decode rows first, then the prefill chunks."""
    config = weights.config
    attn = weights.layers[index].attention
    group = kv.groups[index]
    k_cache, v_cache = kv.key[index], kv.value[index]
    window = config.sliding_window if config.is_sliding(index) else None
    scale = config.head_dim**-0.5
    num_tokens, num_decodes = q.shape[0], metadata.num_decodes
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
