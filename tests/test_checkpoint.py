import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_serve.checkpoint import CheckpointError, expected_tensors, load_checkpoint
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.checkpoint.synthetic import make_checkpoint
from gptoss_serve.config import ModelConfig

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"


def _config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_file(model_dir / "config.json")


def test_single_file_round_trip(tiny_dir: Path) -> None:
    config = _config(tiny_dir)
    tensors = load_checkpoint(tiny_dir, config)
    specs = expected_tensors(config)
    assert set(tensors) == set(specs)
    for name, spec in specs.items():
        assert tuple(tensors[name].shape) == spec.shape
        expected_dtype = torch.uint8 if spec.dtype == "U8" else torch.bfloat16
        assert tensors[name].dtype == expected_dtype, name
    # Experts stay packed: two E2M1 codes per byte, one E8M0 scale per 32 elements.
    e, i, h = config.num_local_experts, config.intermediate_size, config.hidden_size
    assert tensors[BLOCKS].shape == (e, 2 * i, h // 32, 16)
    assert tensors[BLOCKS.replace("blocks", "scales")].shape == (e, 2 * i, h // 32)


def test_sharded_round_trip_matches_single(tmp_path: Path) -> None:
    single = make_checkpoint(tmp_path / "one", "tiny", seed=7, vocab=256, layers=2)
    sharded = make_checkpoint(tmp_path / "three", "tiny", seed=7, vocab=256, layers=2, num_shards=3)
    names = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert names == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in load_file(single / "model.safetensors").values()
    )
    a = load_checkpoint(single, _config(single))
    b = load_checkpoint(sharded, _config(sharded))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _load_error(model_dir: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model_dir, _config(model_dir))
    return str(info.value)


def test_missing_tensor(tiny_dir: Path) -> None:
    _rewrite(tiny_dir / "model.safetensors", lambda t: t.pop(Q_PROJ))
    message = _load_error(tiny_dir)
    assert f"missing tensor '{Q_PROJ}'" in message and str(tiny_dir) in message


def test_unexpected_tensor(tiny_dir: Path) -> None:
    _rewrite(tiny_dir / "model.safetensors", lambda t: t.update(extra=torch.zeros(2)))
    message = _load_error(tiny_dir)
    assert "unexpected tensor 'extra'" in message and "model.safetensors" in message


def test_wrong_shape(tiny_dir: Path) -> None:
    _rewrite(tiny_dir / "model.safetensors", lambda t: t.update({Q_PROJ: t[Q_PROJ][:-1]}))
    message = _load_error(tiny_dir)
    assert f"tensor '{Q_PROJ}' has shape" in message and "model.safetensors" in message


def test_wrong_dtype(tiny_dir: Path) -> None:
    _rewrite(tiny_dir / "model.safetensors", lambda t: t.update({Q_PROJ: t[Q_PROJ].float()}))
    message = _load_error(tiny_dir)
    assert f"tensor '{Q_PROJ}' has dtype F32, expected BF16" in message


def test_packed_experts_must_stay_uint8(tiny_dir: Path) -> None:
    _rewrite(tiny_dir / "model.safetensors", lambda t: t.update({BLOCKS: t[BLOCKS].to(torch.int8)}))
    assert f"tensor '{BLOCKS}' has dtype I8, expected U8" in _load_error(tiny_dir)


def test_truncated_file(tiny_dir: Path) -> None:
    path = tiny_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    message = _load_error(tiny_dir)
    assert str(path) in message and "truncated or corrupt" in message


def test_corrupt_header(tiny_dir: Path) -> None:
    path = tiny_dir / "model.safetensors"
    data = path.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"{" * header_size + data[8 + header_size :])
    message = _load_error(tiny_dir)
    assert str(path) in message and "truncated or corrupt" in message


def test_missing_shard_and_index_errors(tmp_path: Path) -> None:
    sharded = make_checkpoint(tmp_path / "s", "tiny", seed=1, vocab=256, layers=2, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    message = _load_error(sharded)
    assert "model-00002-of-00002.safetensors: file not found" in message

    index = sharded / "model.safetensors.index.json"
    index.unlink()
    assert "sharded checkpoint without model.safetensors.index.json" in _load_error(sharded)

    index.write_text("{}")
    (sharded / "model-00001-of-00002.safetensors").unlink()
    assert "not a valid safetensors index" in _load_error(sharded)


def test_index_lists_tensor_absent_from_shard(tmp_path: Path) -> None:
    sharded = make_checkpoint(tmp_path / "s", "tiny", seed=1, vocab=256, layers=2, num_shards=2)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    message = _load_error(sharded)
    assert "model-00001-of-00002.safetensors" in message
    assert "'model.norm.weight' is listed in model.safetensors.index.json but absent" in message


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    assert "no model.safetensors" in _load_error(tmp_path)


def test_config_mismatch_is_a_shape_error(tiny_dir: Path) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw["hidden_size"] = 64
    (tiny_dir / "config.json").write_text(json.dumps(raw))
    assert "has shape" in _load_error(tiny_dir)


def test_synthetic_checkpoint_has_the_released_config_fields(tiny_dir: Path) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    assert raw["rope_scaling"]["truncate"] is False
    assert raw["architectures"] == ["GptOssForCausalLM"]


def test_synthetic_is_reproducible(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", "tiny", seed=3, vocab=256, layers=2)
    b = make_checkpoint(tmp_path / "b", "tiny", seed=3, vocab=256, layers=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_bad_shard_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_shards"):
        make_checkpoint(tmp_path / "x", "tiny", vocab=256, layers=1, num_shards=1000)
