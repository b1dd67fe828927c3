import json
import math
from pathlib import Path

import pytest

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ConfigError, ModelConfig, ServerConfig

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name,layers,experts", [("20b", 24, 32), ("120b", 36, 128)])
def test_real_configs_parse(name: str, layers: int, experts: int) -> None:
    config = ModelConfig.from_file(DATA / f"gpt-oss-{name}.config.json")
    assert config.num_hidden_layers == layers
    assert config.num_local_experts == experts
    assert config.num_experts_per_tok == 4
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (2880, 2880, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (64, 8)
    assert config.vocab_size == 201088 and config.sliding_window == 128
    assert config.is_sliding(0) and not config.is_sliding(1)
    assert config.rope.truncate is False and config.rope.factor == 32.0
    assert math.isclose(config.rope.attention_scaling, 0.1 * math.log(32) + 1)
    assert config.swiglu_limit == 7.0 and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("name", ["20b", "120b"])
def test_presets_match_the_released_configs(name: str) -> None:
    released = json.loads((DATA / f"gpt-oss-{name}.config.json").read_text())
    assert preset_config(name) == released


def test_config_is_frozen() -> None:
    config = ModelConfig.from_dict(preset_config("tiny"))
    with pytest.raises(AttributeError):
        config.hidden_size = 64  # type: ignore[misc]


def _raw(**changes: object) -> dict:
    raw = preset_config("tiny")
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    "changes,field,words",
    [
        (dict(model_type="llama"), "model_type", "unsupported 'llama'"),
        (dict(hidden_size=None), "hidden_size", "missing"),
        (dict(vocab_size=None), "vocab_size", "missing"),
        (dict(hidden_size=100), "hidden_size", "not a multiple of 32"),
        (dict(intermediate_size=48), "intermediate_size", "not a multiple of 32"),
        (dict(hidden_size="128"), "hidden_size", "expected an integer"),
        (dict(hidden_size=True), "hidden_size", "expected an integer"),
        (dict(num_hidden_layers=0), "num_hidden_layers", "positive"),
        (dict(num_key_value_heads=3), "num_key_value_heads", "does not divide"),
        (dict(experts_per_token=9, num_experts_per_tok=9), "num_experts_per_tok", "exceeds"),
        (dict(layer_types=["sliding_attention"]), "layer_types", "1 entries"),
        (dict(rms_norm_eps=-1), "rms_norm_eps", "positive"),
        (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.rope_type", "yarn"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings", "must be false"),
    ],
)
def test_config_errors_name_the_field(changes: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(_raw(**changes), source="x/config.json")
    assert info.value.field == field
    assert f"'{field}'" in str(info.value) and words in str(info.value)
    assert "x/config.json" in str(info.value)


def test_layer_type_typo_names_the_index() -> None:
    types = ["sliding_attention", "full", "sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"layer_types\[1\]"):
        ModelConfig.from_dict(_raw(layer_types=types))


def test_rope_subfield_missing() -> None:
    rope = dict(preset_config("tiny")["rope_scaling"])
    del rope["beta_fast"]
    with pytest.raises(ConfigError, match=r"rope_scaling\.beta_fast.*missing"):
        ModelConfig.from_dict(_raw(rope_scaling=rope))


def test_unsupported_quantization() -> None:
    with pytest.raises(ConfigError, match=r"quantization_config\.quant_method"):
        ModelConfig.from_dict(_raw(quantization_config={"quant_method": "gptq"}))


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_server_request_limit_is_checked() -> None:
    assert ServerConfig().max_request_bytes == 64 * 2**20
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerConfig(max_request_bytes=100)
