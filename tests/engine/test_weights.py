"""The GPU engine's weights: the checkpoint's tensors land in the right fields, cast to the compute
dtype except the MoE; synthetic weights have the real shapes, also at full size on "meta"."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_serve.checkpoint import CheckpointError, expected_tensors, load_checkpoint
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.checkpoint.synthetic import make_checkpoint
from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.synthetic_weights import (
    SYNTHETIC_MODELS,
    synthetic_layer,
    synthetic_model_config,
    synthetic_weights,
)
from gptoss_serve.engine.weights import ModelWeights, WeightsBuilder, load_weights
from gptoss_serve.kernels.attention import paged_attention_decode_reference
from gptoss_serve.kernels.linear import linear
from gptoss_serve.kernels.moe import mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.rope import rope_and_cache_write, split_qkv
from gptoss_serve.model import load_model
from gptoss_serve.model.rope import yarn_inv_freq

DATA = Path(__file__).resolve().parents[1] / "data"
SEED = 9
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same small random model as one file and as two shards, by number of files."""
    root = tmp_path_factory.mktemp("weights")
    return {
        num_shards: make_checkpoint(
            root / f"shards{num_shards}", "tiny", seed=SEED, vocab=256, layers=2,
            num_shards=num_shards,
        )
        for num_shards in (1, 2)
    }  # fmt: skip


def _moe_field(name: str) -> str:
    """The MoeWeights field of an mlp tensor: mlp.experts.gate_up_proj_blocks -> gate_up_blocks."""
    within = name.split(".mlp.")[1]
    return within.removeprefix("experts.").replace("_proj", "").replace(".", "_")


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_load_weights_maps_every_tensor(
    checkpoints: dict[int, Path], num_shards: int, dtype: torch.dtype
) -> None:
    model_dir = checkpoints[num_shards]
    config = ModelConfig.from_file(model_dir / "config.json")
    raw = load_checkpoint(model_dir, config)
    weights = load_weights(model_dir, device="cpu", dtype=dtype, progress=False)
    assert (weights.config, weights.dtype, weights.device) == (config, dtype, torch.device("cpu"))

    def same(tensor: torch.Tensor, *names: str) -> None:
        expected = torch.cat([raw[name] for name in names])
        assert tensor.dtype == dtype and torch.equal(tensor, expected.to(dtype)), names

    same(weights.embedding, "model.embed_tokens.weight")
    same(weights.final_norm, "model.norm.weight")
    same(weights.lm_head, "lm_head.weight")
    assert torch.equal(weights.inv_freq, yarn_inv_freq(config.head_dim, config.rope))
    assert len(weights.layers) == config.num_hidden_layers
    for index, layer in enumerate(weights.layers):
        prefix, attention = f"model.layers.{index}.", layer.attention
        qkv = [f"{prefix}self_attn.{part}_proj" for part in "qkv"]
        same(attention.qkv_weight, *(f"{name}.weight" for name in qkv))
        same(attention.qkv_bias, *(f"{name}.bias" for name in qkv))
        same(attention.o_weight, f"{prefix}self_attn.o_proj.weight")
        same(attention.o_bias, f"{prefix}self_attn.o_proj.bias")
        same(attention.sinks, f"{prefix}self_attn.sinks")
        same(attention.input_norm, f"{prefix}input_layernorm.weight")
        same(attention.post_norm, f"{prefix}post_attention_layernorm.weight")
        mlp_names = [name for name in raw if name.startswith(f"{prefix}mlp.")]
        assert len(mlp_names) == 8
        for name in mlp_names:  # untouched whatever the dtype: bf16 and packed uint8
            tensor = getattr(layer.moe, _moe_field(name))
            assert tensor.dtype == raw[name].dtype and torch.equal(tensor, raw[name]), name
        layer.moe.check()
    if dtype == torch.bfloat16:  # the checkpoint's bytes, inv_freq and one counter per layer
        checkpoint_bytes = sum(spec.num_bytes for spec in expected_tensors(config).values())
        extra = weights.inv_freq.numel() * 4 + 4 * config.num_hidden_layers
        assert weights.num_bytes() == checkpoint_bytes + extra


def test_damaged_checkpoint_raises_naming_file_and_tensor(tiny_dir: Path) -> None:
    path, name = tiny_dir / "model.safetensors", "model.layers.1.self_attn.sinks"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=f"{tiny_dir}: missing tensor '{name}'"):
        load_weights(tiny_dir, device="cpu", progress=False)


def test_unsupported_dtype_and_incomplete_weights(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_weights(tiny_dir, device="cpu", dtype=torch.float16, progress=False)
    config = ModelConfig.from_file(tiny_dir / "config.json")
    builder = WeightsBuilder(config, torch.bfloat16)
    with pytest.raises(
        ValueError, match=re.escape("unknown tensor 'model.layers.2.mlp.router.weight'")
    ):
        builder.add("model.layers.2.mlp.router.weight", torch.zeros(1))
    builder.add("model.norm.weight", torch.ones(config.hidden_size))
    with pytest.raises(ValueError, match=r"no model.embed_tokens.weight.*model.layers.1.\*"):
        builder.finish()


def _check_shapes(weights: ModelWeights, dtype: torch.dtype) -> None:
    config = weights.config
    v, h, q, kv = config.vocab_size, config.hidden_size, config.q_dim, config.kv_dim
    expected = {"embedding": (v, h), "final_norm": (h,), "lm_head": (v, h)}
    for field, shape in expected.items():
        tensor = getattr(weights, field)
        assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), field
    assert weights.inv_freq.shape == (config.head_dim // 2,)
    assert weights.inv_freq.dtype == torch.float32
    per_layer = {
        "qkv_weight": (q + 2 * kv, h), "qkv_bias": (q + 2 * kv,), "o_weight": (h, q),
        "o_bias": (h,), "sinks": (config.num_attention_heads,), "input_norm": (h,),
        "post_norm": (h,),
    }  # fmt: skip
    assert len(weights.layers) == config.num_hidden_layers
    for layer in weights.layers:
        for field, shape in per_layer.items():
            tensor = getattr(layer.attention, field)
            assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), field
        layer.moe.check()  # MoE shapes, bf16 router and biases, uint8 blocks and scales
        assert layer.moe.num_experts == config.num_local_experts


@pytest.mark.parametrize("dtype", DTYPES)
def test_synthetic_weights_of_the_tiny_preset(dtype: torch.dtype) -> None:
    config = ModelConfig.from_dict(preset_config("tiny"))
    weights = synthetic_weights(config, device="cpu", dtype=dtype)
    _check_shapes(weights, dtype)
    assert (weights.config, weights.dtype, weights.device) == (config, dtype, torch.device("cpu"))
    # Sane scales: norms about 1, lm_head std 2/sqrt(H).
    assert abs(weights.final_norm.float().mean().item() - 1) < 0.05
    h = config.hidden_size
    assert abs(weights.lm_head.float().std().item() * h**0.5 - 2) < 0.05
    layer = synthetic_layer(config, torch.Generator().manual_seed(0), dtype)
    assert layer.attention.qkv_weight.shape == weights.layers[0].attention.qkv_weight.shape
    assert layer.attention.sinks.dtype == dtype
    layer.moe.check()


@pytest.mark.parametrize("name", SYNTHETIC_MODELS)
def test_synthetic_weights_at_full_size_on_meta(name: str) -> None:
    config = synthetic_model_config(name)
    weights = synthetic_weights(config, device="meta")
    assert weights.device.type == "meta"
    _check_shapes(weights, torch.bfloat16)
    checkpoint_bytes = sum(spec.num_bytes for spec in expected_tensors(config).values())
    extra = weights.inv_freq.numel() * 4 + 4 * config.num_hidden_layers
    assert weights.num_bytes() == checkpoint_bytes + extra


def _flat(weights: ModelWeights) -> dict[str, torch.Tensor]:
    tensors = {name: getattr(weights, name) for name in ("embedding", "final_norm", "lm_head")}
    for index, layer in enumerate(weights.layers):
        for part in (layer.attention, layer.moe):
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)  # not step_rows (a layout), not scratch:
                if isinstance(value, torch.Tensor) and field.name != "router_counter":
                    tensors[f"{index}.{field.name}"] = value
    return tensors


def test_synthetic_weights_are_seeded(checkpoints: dict[int, Path]) -> None:
    config = ModelConfig.from_file(checkpoints[1] / "config.json")
    first = _flat(synthetic_weights(config, device="cpu", seed=SEED))
    again = _flat(synthetic_weights(config, device="cpu", seed=SEED))
    other = _flat(synthetic_weights(config, device="cpu", seed=SEED + 1))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["0.qkv_weight"], other["0.qkv_weight"])
    assert not torch.equal(first["1.down_blocks"], other["1.down_blocks"])
    # The draws are make_checkpoint's, in its order: the same seed gives the same model.
    loaded = _flat(load_weights(checkpoints[2], device="cpu", progress=False))
    assert all(torch.equal(first[name], loaded[name]) for name in first)


def test_synthetic_model_configs_are_the_released_ones() -> None:
    assert SYNTHETIC_MODELS == ("synthetic-120b", "synthetic-20b")
    for size in ("120b", "20b"):
        released = ModelConfig.from_file(DATA / f"gpt-oss-{size}.config.json")
        assert synthetic_model_config(f"synthetic-{size}") == released
    for name in ("synthetic-7b", "120b", "demo"):
        with pytest.raises(ValueError, match="unknown synthetic model"):
            synthetic_model_config(name)


def _decode(weights: ModelWeights, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """The tokens one decode step at a time through the engine's ops, as the GPU model runner
    composes them (bench/gpu_model.py's DecodeStep); the last token's logits [1, V]."""
    config = weights.config
    a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    num_blocks = -(-len(token_ids) // block_size)
    cache_shape = (num_blocks, block_size, kv, d)
    caches = [(torch.zeros(cache_shape), torch.zeros(cache_shape)) for _ in weights.layers]
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    for position, token_id in enumerate(token_ids):
        positions, seq_lens = torch.tensor([position]), torch.tensor([position + 1]).int()
        x, residual = weights.embedding[[token_id]], None
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(weights.layers, caches, strict=True)
        ):
            attention, eps = layer.attention, config.rms_norm_eps
            normed, residual = fused_add_rms_norm(x, residual, attention.input_norm, eps)
            qkv = linear(normed, attention.qkv_weight, attention.qkv_bias)
            q, k, v = split_qkv(qkv, a, kv, d)
            q = rope_and_cache_write(
                q, k, v, positions, weights.inv_freq, config.rope.attention_scaling,
                k_cache, v_cache, positions,
            )  # fmt: skip
            out = paged_attention_decode_reference(
                q, k_cache, v_cache, block_table, seq_lens, attention.sinks,
                window=config.sliding_window if config.is_sliding(index) else None, scale=d**-0.5,
            )  # fmt: skip
            x = linear(out.view(1, a * d), attention.o_weight, attention.o_bias)
            normed, residual = fused_add_rms_norm(x, residual, attention.post_norm, eps)
            x = mxfp4_moe(normed, layer.moe, top_k=config.num_experts_per_tok)
        normed, _ = fused_add_rms_norm(x, residual, weights.final_norm, config.rms_norm_eps)
    return linear(normed, weights.lm_head, out_dtype=torch.float32)


def test_decode_through_the_ops_matches_the_plain_torch_model(
    checkpoint_dirs: dict[str, Path],
) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    weights = load_weights(model_dir, device="cpu", dtype=torch.float32, progress=False)
    model = load_model(model_dir, dtype=torch.float32)
    token_ids = [3, 141, 59, 265, 358]
    expected = model(torch.tensor(token_ids), model.new_cache())[-1:]
    logits = _decode(weights, token_ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
