"""The GPU engine's model weights: frozen dataclasses of tensors in the layout the kernels take.

Not nn.Modules: the model runner composes the kernels itself (fused_add_rms_norm, one qkv
linear, rope_and_cache_write, paged attention, the o linear, mxfp4_moe, the lm_head linear), so
a layer is just its tensors. Two choices of layout:

- q, k and v projections are stacked into one [Q + 2K, H] matrix (and one bias), so one GEMV
  computes all three; the split after it is a view.
- the MoE stays MXFP4 as released (``MoeWeights``: MXFP4 blocks and E8M0 scales uint8, router
  and biases bf16) whatever the compute dtype; in float32 "verification mode" the MoE
  reference upcasts inside. On CUDA the blocks' bytes are reordered into the kernels'
  step-rows layout (kernels/mxfp4_layout.py: same size, one layer's blocks copied at a time;
  the reference undoes it). Every other tensor is cast to ``dtype``.

``load_weights`` streams a checkpoint tensor by tensor straight to the device and builds each
layer as soon as its last tensor arrives, so memory peaks at the weights plus one file's worth
of not-yet-complete layers; the qkv concat and, on CUDA, the blocks' re-layout are the only
copies. synthetic_weights.py feeds the
same ``WeightsBuilder`` with random tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from gptoss_serve.checkpoint import expected_tensors, read_checkpoint, validate_checkpoint
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.moe import MoeWeights
from gptoss_serve.kernels.rope import rope_cos_sin_table
from gptoss_serve.model.rope import yarn_inv_freq

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)

# The name map, in the checkpoint's own names (layout.py). Within a layer:
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # stacked in this order
_ATTENTION = {  # AttentionWeights field -> tensor (the qkv fields aside)
    "o_weight": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
}
_MOE = {  # MoeWeights.from_checkpoint argument -> tensor
    "router_weight": "mlp.router.weight",
    "router_bias": "mlp.router.bias",
    "gate_up_blocks": "mlp.experts.gate_up_proj_blocks",
    "gate_up_scales": "mlp.experts.gate_up_proj_scales",
    "gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "down_blocks": "mlp.experts.down_proj_blocks",
    "down_scales": "mlp.experts.down_proj_scales",
    "down_bias": "mlp.experts.down_proj_bias",
}
LAYER_TENSORS = frozenset(
    [f"{prefix}.{kind}" for prefix in _QKV for kind in ("weight", "bias")]
    + list(_ATTENTION.values())
    + list(_MOE.values())
)
# Outside the layers: ModelWeights field -> tensor.
_GLOBAL = {
    "embedding": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention and its two norms; Q = heads·head_dim, K = kv_heads·head_dim."""

    qkv_weight: torch.Tensor  # [Q + 2K, H]: q_proj, k_proj, v_proj rows stacked in that order
    qkv_bias: torch.Tensor  # [Q + 2K]
    o_weight: torch.Tensor  # [H, Q]
    o_bias: torch.Tensor  # [H]
    sinks: torch.Tensor  # [num_attention_heads]
    input_norm: torch.Tensor  # [H] input_layernorm.weight
    post_norm: torch.Tensor  # [H] post_attention_layernorm.weight


@dataclass(frozen=True)
class LayerWeights:
    attention: AttentionWeights
    moe: MoeWeights


@dataclass(frozen=True)
class ModelWeights:
    config: ModelConfig
    embedding: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    inv_freq: torch.Tensor  # [head_dim / 2] float32, YaRN
    dtype: torch.dtype  # of every non-expert tensor
    # [max_position_embeddings, head_dim] float32 cos | sin of every position, for the fused
    # q/k/v + RoPE kernel (kernels/rope.py); on CUDA only (None: the unfused path).
    rope_cos_sin: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def num_bytes(self) -> int:
        """Bytes of every tensor held (experts packed as they are)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self._tensors())

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from _field_tensors(self)
        for layer in self.layers:
            yield from _field_tensors(layer.attention)
            yield from _field_tensors(layer.moe)


def _field_tensors(instance: object) -> Iterator[torch.Tensor]:
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if isinstance(value, torch.Tensor):
            yield value


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")


def build_layer(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> LayerWeights:
    """One layer from its tensors keyed by name within the layer ("self_attn.q_proj.weight",
    ...): the non-expert ones cast to ``dtype``, the MoE ones wrapped as they are."""
    check_dtype(dtype)
    # The concat is the only copy loading makes, one layer at a time; the raw q, k, v go.
    attention = AttentionWeights(
        qkv_weight=torch.cat([tensors[f"{prefix}.weight"] for prefix in _QKV]).to(dtype),
        qkv_bias=torch.cat([tensors[f"{prefix}.bias"] for prefix in _QKV]).to(dtype),
        **{field: tensors[name].to(dtype) for field, name in _ATTENTION.items()},
    )
    moe = MoeWeights.from_checkpoint(**{field: tensors[name] for field, name in _MOE.items()})
    return LayerWeights(attention, moe.for_kernels())  # on CUDA the kernels' blocks layout


class WeightsBuilder:
    """Collects (checkpoint name, tensor) pairs in any order into a ModelWeights, building each
    layer (and dropping its raw tensors) the moment its last tensor arrives."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        check_dtype(dtype)
        self.config = config
        self.dtype = dtype
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._layers: dict[int, LayerWeights] = {}
        self._globals: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            if name not in _GLOBAL.values():
                raise ValueError(f"unknown tensor '{name}'")
            self._globals[name] = tensor.to(self.dtype)
            return
        layer, within = int(match[1]), match[2]
        if within not in LAYER_TENSORS or not 0 <= layer < self.config.num_hidden_layers:
            raise ValueError(f"unknown tensor '{name}'")
        pending = self._pending.setdefault(layer, {})
        pending[within] = tensor
        if len(pending) == len(LAYER_TENSORS):
            self._layers[layer] = build_layer(self._pending.pop(layer), self.dtype)

    def finish(self) -> ModelWeights:
        """The ModelWeights; ValueError naming what never arrived."""
        missing = [name for name in _GLOBAL.values() if name not in self._globals]
        missing += [
            f"model.layers.{layer}.*"
            for layer in range(self.config.num_hidden_layers)
            if layer not in self._layers
        ]
        if missing:
            raise ValueError(f"incomplete weights: no {', '.join(missing)}")
        embedding = self._globals[_GLOBAL["embedding"]]
        config = self.config
        inv_freq = yarn_inv_freq(config.head_dim, config.rope).to(embedding.device)
        cos_sin = None
        if embedding.device.type == "cuda":  # 33.5 MB at 131072 positions
            cos_sin = rope_cos_sin_table(
                config.max_position_embeddings, inv_freq, config.rope.attention_scaling
            )
            # Loading freed the raw layers (and the blocks' pre-layout copies): hand the cached
            # segments back, so that the KV cache is sized from memory really in use.
            torch.cuda.empty_cache()
        return ModelWeights(
            config=config,
            embedding=embedding,
            layers=tuple(self._layers[layer] for layer in range(config.num_hidden_layers)),
            final_norm=self._globals[_GLOBAL["final_norm"]],
            lm_head=self._globals[_GLOBAL["lm_head"]],
            inv_freq=inv_freq,
            dtype=self.dtype,
            rope_cos_sin=cos_sin,
        )


def load_weights(
    model_dir: str | Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> ModelWeights:
    """Read config.json and the safetensors of ``model_dir`` onto ``device``.

    The whole checkpoint is validated (headers only) before any data is read; problems raise
    CheckpointError naming the file and the tensor. ``progress`` shows a bar over the bytes
    read, on a terminal only.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    builder = WeightsBuilder(config, dtype)
    contents = validate_checkpoint(model_dir, config)
    total = sum(spec.num_bytes for spec in expected_tensors(config).values())
    # disable=None: tqdm turns itself off when stderr is not a terminal (logs, CI).
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}",
        disable=None if progress else True,
    ) as bar:  # fmt: skip
        for name, tensor in read_checkpoint(model_dir, contents, device):
            builder.add(name, tensor)
            bar.update(tensor.numel() * tensor.element_size())
    weights = builder.finish()
    logger.info(
        "loaded %s: %d layers, %.2f GB on %s (%s)",
        model_dir, config.num_hidden_layers, weights.num_bytes() / 1e9, weights.device, dtype,
    )  # fmt: skip
    return weights
