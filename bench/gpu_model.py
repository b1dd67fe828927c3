"""One decode step of the whole model composed from our kernels (what the GPU engine's model
runner does, minus scheduling), on random weights of the real shapes drawn on the GPU.

The weights come from gptoss_serve.engine.synthetic_weights (65 GB of 120b do not fit the GPU
machine's disk, and speed does not depend on the values); the benchmarks seed torch from
os.urandom, and the weights take that seed, so every run draws fresh data.
"""

from __future__ import annotations

import torch

from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.synthetic_weights import synthetic_layer, synthetic_weights
from gptoss_serve.engine.weights import ModelWeights
from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.linear import linear, linear_reference
from gptoss_serve.kernels.moe import MoeWeights, mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.rope import qkv_rope_and_cache_write, rope_and_cache_write, split_qkv
from gptoss_serve.kernels.sampling import sample_tokens


def _normal(
    shape: tuple[int, ...], std: float, device: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random bf16 activations or cache contents (the global generator unless one is given)."""
    return (torch.randn(shape, device=device, generator=generator) * std).to(torch.bfloat16)


def random_moe_weights(config: ModelConfig, device: str = "cuda") -> MoeWeights:
    """One layer's MoE weights, seeded from torch's global seed (fresh every run)."""
    generator = torch.Generator(device).manual_seed(torch.initial_seed())
    return synthetic_layer(config, generator).moe


class DecodeStep:
    """One batch-B decode step of the whole model over a paged cache of ``context`` tokens
    per sequence, with static buffers so it can be captured in a CUDA graph. ``dense``:
    "triton" runs the projections through ``kernels.linear`` (the Triton GEMV at small batch)
    and q/k/v with RoPE and the cache write through ``qkv_rope_and_cache_write`` (one fused
    kernel up to ``linear.GEMV_MAX_TOKENS``), as the engine does; "triton-unfused" the q/k/v
    GEMV and the RoPE kernel apart; "cublas" the projections through torch's linear.
    ``weights`` (bf16): given, or synthetic ones drawn from ``seed`` (default: torch's global
    seed); caches and input come from ``seed`` + 1. ``pdl``: the kernels as programmatic
    dependent launches (kernels/launch.py; ``pdl_moe`` for the MoE's, default ``pdl``). Each
    call keeps its logits in ``last_logits``."""

    def __init__(
        self, config: ModelConfig, *, batch: int, context: int, block_size: int = 16,
        device: str = "cuda", dense: str = "triton", weights: ModelWeights | None = None,
        seed: int | None = None, pdl: bool = False, pdl_moe: bool | None = None,
    ) -> None:  # fmt: skip
        seed = torch.initial_seed() if seed is None else seed
        if weights is None:
            weights = synthetic_weights(config, device=device, seed=seed)
        elif weights.config != config:
            raise ValueError("weights were built for another config")
        self.config = config
        self.weights = weights
        self.pdl = pdl
        self.pdl_moe = pdl if pdl_moe is None else pdl_moe
        self.last_logits: torch.Tensor | None = None
        self.dense = {"triton": linear, "triton-unfused": linear, "cublas": linear_reference}[dense]
        self.fused_qkv = dense == "triton"
        h = config.hidden_size
        # Caches and input: their own generator, so the weights' draws do not depend on them.
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.caches = [
            tuple(_normal(cache_shape, 1.0, device, generator) for _ in range(2))
            for _ in range(config.num_hidden_layers)
        ]
        order = torch.randperm(num_blocks, device=device, generator=generator).to(torch.int32)
        self.block_tables = order.view(batch, blocks_per_seq)
        # The new token is the context-th: its K/V go into the last slot of the sequence.
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.positions = self.seq_lens.long() - 1
        last_block = self.block_tables[:, (context - 1) // block_size].long()
        self.slot_mapping = last_block * block_size + (context - 1) % block_size
        self.hidden = _normal((batch, h), 1.0, device, generator)  # the embedded input token
        self.temperature = torch.ones(batch, device=device)
        self.top_p = torch.full((batch,), 0.9, device=device)
        self.seeds = torch.arange(batch, device=device)
        self.steps = torch.zeros(batch, dtype=torch.long, device=device)

    def __call__(self) -> torch.Tensor:
        config = self.config
        d, q_dim = config.head_dim, config.q_dim
        weights, x, residual = self.weights, self.hidden, None
        pdl = self.pdl
        dense_pdl = {"pdl": True} if pdl and self.dense is linear else {}
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(weights.layers, self.caches, strict=True)
        ):
            attn = layer.attention
            normed, residual = fused_add_rms_norm(
                x, residual, attn.input_norm, config.rms_norm_eps, pdl=pdl
            )
            q = self._qkv_rope(attn, normed, k_cache, v_cache, dense_pdl)
            window = config.sliding_window if config.is_sliding(index) else None
            out = paged_attention_decode(
                q, k_cache, v_cache, self.block_tables, self.seq_lens, attn.sinks,
                window=window, scale=d**-0.5, pdl=pdl,
            )  # fmt: skip
            x = self.dense(out.view(-1, q_dim), attn.o_weight, attn.o_bias, **dense_pdl)
            normed, residual = fused_add_rms_norm(
                x, residual, attn.post_norm, config.rms_norm_eps, pdl=pdl
            )
            x = mxfp4_moe(normed, layer.moe, top_k=config.num_experts_per_tok, pdl=self.pdl_moe)
        normed, _ = fused_add_rms_norm(
            x, residual, weights.final_norm, config.rms_norm_eps, pdl=pdl
        )
        logits = self.dense(normed, weights.lm_head, out_dtype=torch.float32, **dense_pdl)
        self.last_logits = logits
        return sample_tokens(logits, self.temperature, self.top_p, self.seeds, self.steps)

    def _qkv_rope(self, attn, normed, k_cache, v_cache, dense_pdl) -> torch.Tensor:
        """The rotated q [B, A, D]; this step's K/V written into the caches."""
        config, weights = self.config, self.weights
        a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        rope_args = (self.positions, weights.inv_freq, config.rope.attention_scaling, k_cache,
                     v_cache, self.slot_mapping)  # fmt: skip
        if self.fused_qkv:
            return qkv_rope_and_cache_write(
                normed, attn.qkv_weight, attn.qkv_bias, *rope_args, num_heads=a,
                num_kv_heads=kv, cos_sin=weights.rope_cos_sin, pdl=self.pdl,
            )  # fmt: skip
        qkv = self.dense(normed, attn.qkv_weight, attn.qkv_bias, **dense_pdl)
        return rope_and_cache_write(
            *split_qkv(qkv, a, kv, d),
            *rope_args,
            pdl=self.pdl,
        )
