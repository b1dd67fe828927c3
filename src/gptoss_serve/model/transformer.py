"""gpt-oss as a causal language model over one sequence with an explicit KV cache.

This plain-torch model is the dense oracle of the project: readable, exact in float32 (it
matches HF transformers within 1e-3 on random checkpoints), and what every fast path is
checked against.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from gptoss_serve.checkpoint import load_checkpoint
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.rope import rope_cos_sin
from gptoss_serve.model.kv_cache import KVCache
from gptoss_serve.model.layers import DecoderLayer, RMSNorm
from gptoss_serve.model.rope import yarn_inv_freq

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Dequantize all experts once at load when that costs at most this much memory.
DENSE_EXPERTS_MAX_BYTES = 2 << 30


class GptOssModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GptOssModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        self.lm_head.requires_grad_(False)
        self.register_buffer(
            "inv_freq", yarn_inv_freq(config.head_dim, config.rope), persistent=False
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self) -> KVCache:
        windows = [layer.self_attn.window for layer in self.model.layers]
        return KVCache.empty(windows)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, cache: KVCache, *, last_only: bool = False
    ) -> torch.Tensor:
        """token_ids [T] continuing the sequence in ``cache`` -> logits [T, V] (or [1, V]).

        The cache is advanced by T. Logits are in the model's compute dtype.
        """
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(
                f"token_ids must be a non-empty 1-D tensor, got {tuple(token_ids.shape)}"
            )
        start = cache.length
        positions = torch.arange(start, start + token_ids.numel(), device=self.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.config.rope.attention_scaling)
        x = self.model.embed_tokens(token_ids.to(self.device))  # [T, H]
        for layer, layer_cache in zip(self.model.layers, cache.layers, strict=True):
            x = layer(x, cos, sin, layer_cache, start)
        cache.advance(token_ids.numel())
        if last_only:
            x = x[-1:]
        return self.lm_head(self.model.norm(x))


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dense_experts: bool | None = None,
) -> GptOssForCausalLM:
    """Load config.json + safetensors from ``model_dir``. MXFP4 experts stay packed unless
    ``dense_experts`` (default: when dequantizing them all costs <= 2 GiB)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    tensors = load_checkpoint(model_dir, config, device=device)
    for name, tensor in tensors.items():
        if tensor.dtype != torch.uint8:  # packed MXFP4 stays as it is
            tensors[name] = tensor.to(dtype)
    model = GptOssForCausalLM(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to(device)
    if dense_experts is None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        expert_elements = 3 * config.hidden_size * config.intermediate_size
        dense_bytes = (
            config.num_hidden_layers * config.num_local_experts * expert_elements * itemsize
        )
        dense_experts = dense_bytes <= DENSE_EXPERTS_MAX_BYTES
    if dense_experts:
        for layer in model.model.layers:
            layer.mlp.experts.densify()
    logger.info("loaded %s (%s, %s, dense experts: %s)", model_dir, dtype, device, dense_experts)
    return model.eval()
