"""Random gpt-oss weights of the real shapes built directly on the GPU, and one decode step
composed from our kernels (what the GPU engine's model runner will do, minus scheduling).

65 GB of 120b weights do not fit the GPU machine's disk, and speed does not depend on the
values, so benchmarks draw them on the device: packed MXFP4 experts as random bytes with
sane E8M0 exponents, everything else random bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.linear import linear, linear_reference
from gptoss_serve.kernels.moe import MoeWeights, mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.rope import rope_and_cache_write
from gptoss_serve.kernels.sampling import sample_tokens
from gptoss_serve.model.rope import yarn_inv_freq

E2M1_RMS = 2.93  # RMS of a uniformly random E2M1 code


def _normal(shape: tuple[int, ...], std: float, device: str) -> torch.Tensor:
    return (torch.randn(shape, device=device) * std).to(torch.bfloat16)


def _scales(shape: tuple[int, ...], target_std: float, device: str) -> torch.Tensor:
    base = 127 + round(math.log2(target_std / E2M1_RMS))
    return torch.randint(base - 1, base + 2, shape, dtype=torch.uint8, device=device)


def random_moe_weights(config: ModelConfig, device: str = "cuda") -> MoeWeights:
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    return MoeWeights.from_checkpoint(
        router_weight=_normal((e, h), h**-0.5, device),
        router_bias=_normal((e,), 0.1, device),
        gate_up_blocks=torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8,
                                     device=device),
        gate_up_scales=_scales((e, 2 * i, h // 32), 4.0 / math.sqrt(h), device),
        gate_up_bias=_normal((e, 2 * i), 0.5, device),
        down_blocks=torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, device=device),
        down_scales=_scales((e, h, i // 32), 0.1 / math.sqrt(i), device),
        down_bias=_normal((e, h), 0.1, device),
    )  # fmt: skip


@dataclass
class AttentionWeights:
    qkv_weight: torch.Tensor  # [Q + 2K, H]: q, k and v projections stacked
    qkv_bias: torch.Tensor
    o_weight: torch.Tensor  # [H, Q]
    o_bias: torch.Tensor
    sinks: torch.Tensor  # [A]
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]


def random_attention_weights(config: ModelConfig, device: str = "cuda") -> AttentionWeights:
    h, q, kv = config.hidden_size, config.q_dim, config.kv_dim
    return AttentionWeights(
        qkv_weight=_normal((q + 2 * kv, h), 1.5 * h**-0.5, device),
        qkv_bias=_normal((q + 2 * kv,), 0.1, device),
        o_weight=_normal((h, q), 0.5 * q**-0.5, device),
        o_bias=_normal((h,), 0.1, device),
        sinks=_normal((config.num_attention_heads,), 1.5, device),
        input_norm=(1 + _normal((h,), 0.1, device).float()).to(torch.bfloat16),
        post_norm=(1 + _normal((h,), 0.1, device).float()).to(torch.bfloat16),
    )


class DecodeStep:
    """One batch-B decode step of the whole model over a paged cache of ``context`` tokens
    per sequence, with static buffers so it can be captured in a CUDA graph. ``dense``:
    "triton" runs the projections through ``kernels.linear`` (the Triton GEMV at small batch),
    "cublas" through torch's linear."""

    def __init__(
        self, config: ModelConfig, *, batch: int, context: int, block_size: int = 16,
        device: str = "cuda", dense: str = "triton",
    ) -> None:  # fmt: skip
        self.config = config
        self.dense = {"triton": linear, "cublas": linear_reference}[dense]
        self.layers = [
            (random_attention_weights(config, device), random_moe_weights(config, device))
            for _ in range(config.num_hidden_layers)
        ]
        h, v = config.hidden_size, config.vocab_size
        self.final_norm = torch.ones(h, dtype=torch.bfloat16, device=device)
        self.lm_head = _normal((v, h), 2 * h**-0.5, device)
        self.inv_freq = yarn_inv_freq(config.head_dim, config.rope).to(device)
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.caches = [
            (_normal(cache_shape, 1.0, device), _normal(cache_shape, 1.0, device))
            for _ in range(config.num_hidden_layers)
        ]
        order = torch.randperm(num_blocks, device=device).to(torch.int32)
        self.block_tables = order.view(batch, blocks_per_seq)
        # The new token is the context-th: its K/V go into the last slot of the sequence.
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.positions = self.seq_lens.long() - 1
        last_block = self.block_tables[:, (context - 1) // block_size].long()
        self.slot_mapping = last_block * block_size + (context - 1) % block_size
        self.hidden = _normal((batch, h), 1.0, device)  # the embedded input token
        self.temperature = torch.ones(batch, device=device)
        self.top_p = torch.full((batch,), 0.9, device=device)
        self.seeds = torch.arange(batch, device=device)
        self.steps = torch.zeros(batch, dtype=torch.long, device=device)

    def __call__(self) -> torch.Tensor:
        config = self.config
        a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_dim, kv_dim = config.q_dim, config.kv_dim
        x, residual = self.hidden, None
        for index, ((attn, moe), (k_cache, v_cache)) in enumerate(
            zip(self.layers, self.caches, strict=True)
        ):
            normed, residual = fused_add_rms_norm(x, residual, attn.input_norm, config.rms_norm_eps)
            qkv = self.dense(normed, attn.qkv_weight, attn.qkv_bias)
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            batch = q.shape[0]
            q = rope_and_cache_write(
                q.view(batch, a, d), k.view(batch, kv, d), v.view(batch, kv, d), self.positions,
                self.inv_freq, config.rope.attention_scaling, k_cache, v_cache, self.slot_mapping,
            )  # fmt: skip
            window = config.sliding_window if config.is_sliding(index) else None
            out = paged_attention_decode(
                q, k_cache, v_cache, self.block_tables, self.seq_lens, attn.sinks,
                window=window, scale=d**-0.5,
            )  # fmt: skip
            x = self.dense(out.view(batch, q_dim), attn.o_weight, attn.o_bias)
            normed, residual = fused_add_rms_norm(x, residual, attn.post_norm, config.rms_norm_eps)
            x = mxfp4_moe(normed, moe, top_k=config.num_experts_per_tok)
        normed, _ = fused_add_rms_norm(x, residual, self.final_norm, config.rms_norm_eps)
        logits = self.dense(normed, self.lm_head, out_dtype=torch.float32)
        return sample_tokens(logits, self.temperature, self.top_p, self.seeds, self.steps)
