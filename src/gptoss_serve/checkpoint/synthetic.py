"""Random-weight gpt-oss checkpoints in exactly the released on-disk layout.

No real weights can be downloaded where we test, so correctness is established on these.
The scales are chosen so that the model is *not* degenerate (plain std-0.02 weights make
attention uniform and keep every activation far from the SwiGLU clamp, hiding bugs):

* q/k projections give attention logits with std ~2, so softmax is peaked and the sliding
  window and the sinks change the result;
* gate/up pre-activations have std ~4, so the ±7 clamps bind on a few percent of elements;
* MXFP4 codes are uniform over all 16 E2M1 values with per-block E8M0 exponents jittered by
  ±1 around a fan-in-derived base, so every code and several scales occur;
* the router logits have std ~1 so expert choices vary from token to token.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from gptoss_serve.checkpoint.layout import TensorSpec, expected_tensors
from gptoss_serve.checkpoint.loader import INDEX_FILE, SINGLE_FILE
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig

logger = logging.getLogger(__name__)

# RMS of a uniformly random E2M1 code: sqrt(mean(v^2) over ±{0,.5,1,1.5,2,3,4,6}).
_E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)
_GATE_UP_STD = 4.0  # target std of gate/up pre-activations (the clamp is at 7)
_SWIGLU_RMS = 10.0  # rough RMS of the clamped SwiGLU output at that std
E8M0_BIAS = 127


def make_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    num_shards: int = 1,
    **overrides: int | None,
) -> Path:
    """Write config.json and safetensors file(s) for a random model; return ``out_dir``."""
    out_dir = Path(out_dir)
    raw = preset_config(preset, **overrides)
    config = ModelConfig.from_dict(raw, source=f"preset {preset}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")

    specs = list(expected_tensors(config).values())
    shards = _split(specs, num_shards)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard_index, shard in enumerate(shards):
        file_name = (
            SINGLE_FILE
            if num_shards == 1
            else f"model-{shard_index + 1:05d}-of-{num_shards:05d}.safetensors"
        )
        tensors = {spec.name: random_tensor(spec, generator) for spec in shard}
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_bytes += tensor.numel() * tensor.element_size()
        logger.info("wrote %s (%d tensors)", file_name, len(tensors))
    if num_shards > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _split(specs: list[TensorSpec], num_shards: int) -> list[list[TensorSpec]]:
    """Contiguous shards of roughly equal bytes, none empty (as HF's save_pretrained does)."""
    if not 1 <= num_shards <= len(specs):
        raise ValueError(f"num_shards must be between 1 and {len(specs)}, got {num_shards}")
    sizes = [spec.num_bytes for spec in specs]
    target = sum(sizes) / num_shards
    shards: list[list[TensorSpec]] = [[]]
    filled = 0.0
    for position, (spec, size) in enumerate(zip(specs, sizes, strict=True)):
        remaining_specs = len(specs) - position
        remaining_shards = num_shards - len(shards)
        must_open = remaining_specs == remaining_shards  # one tensor left per shard to fill
        if shards[-1] and remaining_shards > 0 and (filled >= target or must_open):
            shards.append([])
            filled = 0.0
        shards[-1].append(spec)
        filled += size
    return shards


def random_tensor(
    spec: TensorSpec, generator: torch.Generator, device: str | torch.device | None = None
) -> torch.Tensor:
    """One tensor of ``spec``'s shape and dtype with the scale its role calls for, drawn on
    ``device`` (default: the generator's; "meta" takes a CPU generator and draws nothing)."""
    device = generator.device if device is None else device
    suffix = spec.name.rsplit(".", 1)[-1]
    if suffix.endswith("_blocks"):
        return torch.randint(
            0, 256, spec.shape, dtype=torch.uint8, generator=generator, device=device
        )
    if suffix.endswith("_scales"):
        return _random_scales(spec, generator, device)
    std, mean = _std_and_mean(spec)
    values = torch.randn(spec.shape, generator=generator, device=device) * std + mean
    return values.to(torch.bfloat16)


def _random_scales(
    spec: TensorSpec, generator: torch.Generator, device: str | torch.device
) -> torch.Tensor:
    """E8M0 exponents around a fan-in-derived base, jittered by ±1 per 32-element block."""
    fan_in = spec.shape[-1] * 32
    if spec.name.endswith("gate_up_proj_scales"):
        target = _GATE_UP_STD / math.sqrt(fan_in)  # per-element std for std-4 outputs
    else:
        target = 1.0 / (_SWIGLU_RMS * math.sqrt(fan_in))  # down_proj: output std ~1
    base = E8M0_BIAS + round(math.log2(target / _E2M1_RMS))
    jitter = torch.randint(-1, 2, spec.shape, generator=generator, device=device)
    return (base + jitter).to(torch.uint8)


# (std, mean) by the last one or two parts of the name; weights get gain / sqrt(fan_in).
_FIXED_INIT = {
    "sinks": (1.5, 1.0),
    "gate_up_proj_bias": (0.5, 0.0),
    "down_proj_bias": (0.1, 0.0),
    "bias": (0.1, 0.0),
    "embed_tokens.weight": (1.0, 0.0),
}
# q, k: attention logits q·k/sqrt(d) with std ~2; lm_head: logits with std ~2.
_WEIGHT_GAIN = {"q_proj": 1.5, "k_proj": 1.5, "o_proj": 0.5, "lm_head": 2.0}


def _std_and_mean(spec: TensorSpec) -> tuple[float, float]:
    module, suffix = spec.name.split(".")[-2:]
    if module.endswith("norm"):
        return 0.1, 1.0
    for key in (f"{module}.{suffix}", suffix):
        if key in _FIXED_INIT:
            return _FIXED_INIT[key]
    return _WEIGHT_GAIN.get(module, 1.0) / math.sqrt(spec.shape[-1]), 0.0
