"""The building blocks of a gpt-oss decoder layer as nn.Modules.

Parameter names follow the checkpoint's (``self_attn.q_proj.weight``, ``mlp.experts.
gate_up_proj_blocks`` ...) so the loader's name map stays a table.
"""

from __future__ import annotations

import torch
from torch import nn

from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.attention import sink_attention
from gptoss_serve.kernels.moe import moe, route
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from gptoss_serve.kernels.norm import rms_norm
from gptoss_serve.kernels.rope import apply_rope
from gptoss_serve.model.kv_cache import LayerCache


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=True, device="meta")
    layer.requires_grad_(False)
    return layer


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.scale = config.head_dim**-0.5
        self.q_proj = _linear(config.hidden_size, config.q_dim)
        self.k_proj = _linear(config.hidden_size, config.kv_dim)
        self.v_proj = _linear(config.hidden_size, config.kv_dim)
        self.o_proj = _linear(config.q_dim, config.hidden_size)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads, device="meta"))
        self.sinks.requires_grad_(False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        query_start: int,
    ) -> torch.Tensor:
        """x [T, H] for positions query_start.. ; cos/sin [T, D/2]. Returns [T, H]."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, key_start = cache.append(k, v)
        out = sink_attention(
            q,
            keys,
            values,
            self.sinks,
            query_start=query_start,
            key_start=key_start,
            window=self.window,
            scale=self.scale,
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class Experts(nn.Module):
    """The MXFP4 experts, kept packed; dequantized per use, or once if ``dense`` is set."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        meta = {"device": "meta"}
        self.register_buffer("gate_up_proj_blocks", torch.empty(e, 2 * i, h // 32, 16, **meta))
        self.register_buffer("gate_up_proj_scales", torch.empty(e, 2 * i, h // 32, **meta))
        self.register_buffer("down_proj_blocks", torch.empty(e, h, i // 32, 16, **meta))
        self.register_buffer("down_proj_scales", torch.empty(e, h, i // 32, **meta))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, **meta), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, **meta), requires_grad=False)
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.gate_up_proj_bias.dtype

    def densify(self) -> None:
        """Dequantize every expert once (small models: trades memory for decode speed)."""
        self.dense = (
            dequantize_mxfp4(
                self.gate_up_proj_blocks, self.gate_up_proj_scales, self.compute_dtype
            ),
            dequantize_mxfp4(self.down_proj_blocks, self.down_proj_scales, self.compute_dtype),
        )

    def weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert in the compute dtype."""
        if self.dense is not None:
            return self.dense[0][expert], self.dense[1][expert]
        dtype = self.compute_dtype
        return (
            dequantize_mxfp4(
                self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype
            ),
            dequantize_mxfp4(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype),
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit
        self.router = _linear(config.hidden_size, config.num_local_experts)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        routing_weights, expert_ids = route(self.router(x), self.top_k)  # [T, k] each
        return moe(
            x,
            routing_weights,
            expert_ids,
            self.experts.weights,
            gate_up_bias=self.experts.gate_up_proj_bias,
            down_bias=self.experts.down_proj_bias,
            alpha=self.alpha,
            limit=self.limit,
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        query_start: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, query_start)
        return x + self.mlp(self.post_attention_layernorm(x))
