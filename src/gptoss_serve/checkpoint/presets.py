"""Shapes of the released gpt-oss models and of our tiny test/demo model, as config.json dicts.

The real values are those of the published config.json files (gpt-oss-20b and -120b); the
tiny preset keeps the real vocabulary and every architectural feature (grouped heads with
q_dim != hidden, sliding/full alternation, 8 experts with top-4, YaRN) at a size that runs
fast on two CPU cores.
"""

from __future__ import annotations

import copy
from typing import Any

HARMONY_VOCAB_SIZE = 201088

_COMMON: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "hidden_act": "silu",
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "output_router_logits": False,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": HARMONY_VOCAB_SIZE,
}

_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "experts_per_token": 4,
    },
    "20b": {
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "experts_per_token": 4,
    },
    "120b": {
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "experts_per_token": 4,
    },
}
PRESETS = tuple(_SHAPES)

# CLI override flags -> config.json fields.
OVERRIDE_FIELDS = {
    "layers": "num_hidden_layers",
    "experts": "num_local_experts",
    "experts_per_token": "experts_per_token",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
    "sliding_window": "sliding_window",
}


def preset_config(preset: str, **overrides: int | None) -> dict[str, Any]:
    """A config.json dict for ``preset`` with optional shape overrides (see OVERRIDE_FIELDS)."""
    if preset not in _SHAPES:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    raw = copy.deepcopy(_COMMON) | dict(_SHAPES[preset])
    for key, value in overrides.items():
        if key not in OVERRIDE_FIELDS:
            raise ValueError(f"unknown override {key!r}")
        if value is not None:
            raw[OVERRIDE_FIELDS[key]] = value
    for special in ("eos_token_id", "pad_token_id"):
        if raw[special] >= raw["vocab_size"]:  # a shrunken test vocabulary has no Harmony ids
            raw[special] = None
    raw["num_experts_per_tok"] = raw["experts_per_token"]  # HF's name for the same field
    raw["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    return dict(sorted(raw.items()))
