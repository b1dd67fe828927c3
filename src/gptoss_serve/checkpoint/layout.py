"""The declarative name map: every tensor of a gpt-oss checkpoint, its shape and dtype.

The names are the checkpoint's own (and the model's parameter names follow them), so loading
is a table lookup. Shapes are written with the config's field names and resolved per config.
Expert weights stay MXFP4 as released: ``*_blocks`` are uint8 bytes holding two E2M1 codes,
``*_scales`` are uint8 E8M0 exponents, one per 32 elements (OCP MX v1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptoss_serve.config import MXFP4_BLOCK_SIZE, ModelConfig

BF16 = "BF16"
U8 = "U8"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: "BF16" or "U8"

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * (1 if self.dtype == U8 else 2)


# (name template, shape in config terms, dtype). "{i}" is the layer index.
# Dimension names: V vocab, H hidden, I intermediate, Q q_dim, K kv_dim, A heads, E experts,
# HB/IB = H/32, I/32 MXFP4 blocks per row, and 16 bytes per 32-element block.
_GLOBAL = (
    ("model.embed_tokens.weight", ("V", "H"), BF16),
    ("model.norm.weight", ("H",), BF16),
    ("lm_head.weight", ("V", "H"), BF16),
)
_PER_LAYER = (
    ("model.layers.{i}.input_layernorm.weight", ("H",), BF16),
    ("model.layers.{i}.post_attention_layernorm.weight", ("H",), BF16),
    ("model.layers.{i}.self_attn.q_proj.weight", ("Q", "H"), BF16),
    ("model.layers.{i}.self_attn.q_proj.bias", ("Q",), BF16),
    ("model.layers.{i}.self_attn.k_proj.weight", ("K", "H"), BF16),
    ("model.layers.{i}.self_attn.k_proj.bias", ("K",), BF16),
    ("model.layers.{i}.self_attn.v_proj.weight", ("K", "H"), BF16),
    ("model.layers.{i}.self_attn.v_proj.bias", ("K",), BF16),
    ("model.layers.{i}.self_attn.o_proj.weight", ("H", "Q"), BF16),
    ("model.layers.{i}.self_attn.o_proj.bias", ("H",), BF16),
    ("model.layers.{i}.self_attn.sinks", ("A",), BF16),
    ("model.layers.{i}.mlp.router.weight", ("E", "H"), BF16),
    ("model.layers.{i}.mlp.router.bias", ("E",), BF16),
    # gate_up rows interleave gate and up: row 2j is gate j, row 2j+1 is up j.
    ("model.layers.{i}.mlp.experts.gate_up_proj_blocks", ("E", "2I", "HB", 16), U8),
    ("model.layers.{i}.mlp.experts.gate_up_proj_scales", ("E", "2I", "HB"), U8),
    ("model.layers.{i}.mlp.experts.gate_up_proj_bias", ("E", "2I"), BF16),
    ("model.layers.{i}.mlp.experts.down_proj_blocks", ("E", "H", "IB", 16), U8),
    ("model.layers.{i}.mlp.experts.down_proj_scales", ("E", "H", "IB"), U8),
    ("model.layers.{i}.mlp.experts.down_proj_bias", ("E", "H"), BF16),
)


def _dims(config: ModelConfig) -> dict[str, int]:
    return {
        "V": config.vocab_size,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "2I": 2 * config.intermediate_size,
        "Q": config.q_dim,
        "K": config.kv_dim,
        "A": config.num_attention_heads,
        "E": config.num_local_experts,
        "HB": config.hidden_size // MXFP4_BLOCK_SIZE,
        "IB": config.intermediate_size // MXFP4_BLOCK_SIZE,
    }


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for ``config`` holds, in a stable order (embeddings first)."""
    dims = _dims(config)

    def spec(name: str, shape: tuple, dtype: str) -> TensorSpec:
        resolved = tuple(d if isinstance(d, int) else dims[d] for d in shape)
        return TensorSpec(name, resolved, dtype)

    specs = [spec(*_GLOBAL[0])]
    for layer in range(config.num_hidden_layers):
        specs += [spec(name.format(i=layer), shape, dtype) for name, shape, dtype in _PER_LAYER]
    specs += [spec(*entry) for entry in _GLOBAL[1:]]
    return {s.name: s for s in specs}
