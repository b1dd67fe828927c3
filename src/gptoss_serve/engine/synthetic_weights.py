"""Random gpt-oss weights of the exact shapes, drawn directly on the device.

65 GB of 120b weights do not fit the GPU machine's disk, no real weights exist where we test,
and speed does not depend on the values: benchmarks and ``--model synthetic-120b`` draw them
on the device instead. The draws are those of checkpoint/synthetic.py (``random_tensor``: MXFP4
codes uniform over all 16 values with E8M0 exponents chosen from the fan-in so activations stay
sane, norms ≈ 1, lm_head std 2/√H), in the checkpoint's tensor order from one generator, so
on the CPU ``synthetic_weights(config, seed=s)`` equals ``load_weights`` of a checkpoint that
``make_checkpoint`` wrote with seed s.
"""

from __future__ import annotations

import logging

import torch

from gptoss_serve.checkpoint import expected_tensors
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.checkpoint.synthetic import random_tensor
from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.weights import LayerWeights, ModelWeights, WeightsBuilder, build_layer

logger = logging.getLogger(__name__)

SYNTHETIC_MODELS = ("synthetic-120b", "synthetic-20b")


def synthetic_model_config(name: str) -> ModelConfig:
    """The released config of ``name``'s model ("synthetic-120b" or "synthetic-20b")."""
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r} (choose from {SYNTHETIC_MODELS})")
    preset = name.removeprefix("synthetic-")
    return ModelConfig.from_dict(preset_config(preset), source=f"preset {preset}")


def synthetic_weights(
    config: ModelConfig,
    *,
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> ModelWeights:
    """Random weights for ``config`` on ``device`` (non-expert tensors in ``dtype``); the same
    seed and device give the same tensors. On "meta" only shapes and dtypes exist."""
    device = torch.device(device)
    # The meta device has no generator; a CPU one serves, as nothing is drawn there.
    generator = torch.Generator("cpu" if device.type == "meta" else device).manual_seed(seed)
    builder = WeightsBuilder(config, dtype)
    # One tensor at a time in the checkpoint's order: each layer is built as its last tensor
    # is drawn, so nothing but the finished weights stays on the device.
    for spec in expected_tensors(config).values():
        builder.add(spec.name, random_tensor(spec, generator, device))
    weights = builder.finish()
    logger.info(
        "synthetic weights: %d layers, %.2f GB on %s (%s, seed %d)",
        config.num_hidden_layers, weights.num_bytes() / 1e9, device, dtype, seed,
    )  # fmt: skip
    return weights


def synthetic_layer(
    config: ModelConfig, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> LayerWeights:
    """One layer of random weights (layer 0's shapes) on the generator's device, for
    benchmarks of a single op."""
    prefix = "model.layers.0."
    tensors = {
        spec.name.removeprefix(prefix): random_tensor(spec, generator)
        for spec in expected_tensors(config).values()
        if spec.name.startswith(prefix)
    }
    return build_layer(tensors, dtype)
