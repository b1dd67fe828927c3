"""Frozen configuration parsed from a Hugging Face ``config.json`` of model_type ``gpt_oss``.

Standard library only; nothing here reads argv or the environment (that is cli.py's job).
Every validation error names the offending field so a user can fix their config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("gpt_oss",)
SLIDING = "sliding_attention"
FULL = "full_attention"
# MXFP4 (OCP MX v1.0): one shared E8M0 scale per 32 consecutive elements.
MXFP4_BLOCK_SIZE = 32


class ConfigError(ValueError):
    """A config.json that gptoss-serve cannot serve; ``field`` names the culprit."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}config field '{field}': {message}")
        self.field = field


@dataclass(frozen=True)
class RopeConfig:
    """YaRN rotary embedding (arXiv:2309.00071), as gpt-oss uses it."""

    theta: float
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    # gpt-oss sets ``truncate: false``: the correction range is not floored/ceiled.
    truncate: bool

    @property
    def attention_scaling(self) -> float:
        """YaRN's cos/sin scale ("concentration"): 0.1·ln(factor) + 1."""
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1.0 else 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    swiglu_limit: float
    max_position_embeddings: int
    rope: RopeConfig
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Not in config.json: a constant of the architecture (SwiGLU with sigmoid(1.702·x)).
    swiglu_alpha: float = 1.702

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    # -- parsing -------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("<file>", "config.json not found", str(path)) from None
        except json.JSONDecodeError as error:
            raise ConfigError("<file>", f"not valid JSON ({error})", str(path)) from error
        if not isinstance(raw, dict):
            raise ConfigError("<file>", "top level must be a JSON object", str(path))
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str | None = None) -> ModelConfig:
        reader = _Reader(raw, source)
        model_type = reader.get("model_type", str)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                "model_type", f"unsupported {model_type!r} (supported: gpt_oss)", source
            )
        num_layers = reader.positive_int("num_hidden_layers")
        num_experts = reader.positive_int("num_local_experts")
        config = cls(
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=reader.positive_int("hidden_size"),
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=reader.positive_int("num_attention_heads"),
            num_key_value_heads=reader.positive_int("num_key_value_heads"),
            head_dim=reader.positive_int("head_dim"),
            num_local_experts=num_experts,
            num_experts_per_tok=_experts_per_token(reader),
            sliding_window=reader.positive_int("sliding_window"),
            layer_types=_layer_types(reader, num_layers),
            rms_norm_eps=reader.positive_float("rms_norm_eps"),
            swiglu_limit=reader.positive_float("swiglu_limit"),
            max_position_embeddings=reader.positive_int("max_position_embeddings"),
            rope=_rope(reader),
            eos_token_id=reader.optional_int("eos_token_id"),
            pad_token_id=reader.optional_int("pad_token_id"),
        )
        _check_consistency(config, reader)
        return config


class _Reader:
    """Typed access to the raw dict; every failure names the field."""

    def __init__(self, raw: dict[str, Any], source: str | None) -> None:
        self.raw = raw
        self.source = source

    def fail(self, field: str, message: str) -> ConfigError:
        return ConfigError(field, message, self.source)

    def get(self, field: str, kind: type | tuple[type, ...], raw: dict | None = None) -> Any:
        raw = self.raw if raw is None else raw
        if field not in raw:
            raise self.fail(field, "missing")
        value = raw[field]
        # bool is an int in Python; a config saying `"hidden_size": true` is still wrong.
        if isinstance(value, bool) and kind is not bool:
            raise self.fail(field, f"expected {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(field, f"expected {_kind_name(kind)}, got {value!r}")
        return value

    def positive_int(self, field: str, raw: dict | None = None) -> int:
        value = self.get(field, int, raw)
        if value <= 0:
            raise self.fail(field, f"must be a positive integer, got {value}")
        return value

    def positive_float(self, field: str, raw: dict | None = None) -> float:
        value = float(self.get(field, (int, float), raw))
        if not (value > 0 and math.isfinite(value)):
            raise self.fail(field, f"must be a positive finite number, got {value}")
        return value

    def optional_int(self, field: str) -> int | None:
        value = self.raw.get(field)
        if value is None:
            return None
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return value[0]  # HF allows a list of EOS ids; Harmony supplies the real stops
        return self.get(field, int)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _experts_per_token(reader: _Reader) -> int:
    # HF's name is num_experts_per_tok; OpenAI's original is experts_per_token. Either will do.
    field = "num_experts_per_tok" if "num_experts_per_tok" in reader.raw else "experts_per_token"
    return reader.positive_int(field)


def _layer_types(reader: _Reader, num_layers: int) -> tuple[str, ...]:
    if "layer_types" not in reader.raw:
        # gpt-oss alternates, starting with a sliding layer (HF's default too).
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    types = reader.get("layer_types", list)
    if len(types) != num_layers:
        raise reader.fail(
            "layer_types", f"has {len(types)} entries but num_hidden_layers is {num_layers}"
        )
    for i, kind in enumerate(types):
        if kind not in (SLIDING, FULL):
            raise reader.fail(
                f"layer_types[{i}]", f"unknown layer type {kind!r} (expected {SLIDING} or {FULL})"
            )
    return tuple(types)


def _rope(reader: _Reader) -> RopeConfig:
    theta = reader.positive_float("rope_theta")
    scaling = reader.raw.get("rope_scaling") or reader.raw.get("rope_parameters")
    if scaling is None:
        raise reader.fail("rope_scaling", "missing (gpt-oss uses YaRN)")
    if not isinstance(scaling, dict):
        raise reader.fail("rope_scaling", f"expected an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "yarn":
        raise reader.fail("rope_scaling.rope_type", f"unsupported {rope_type!r} (expected 'yarn')")

    def sub(field: str) -> float:
        if field not in scaling:
            raise reader.fail(f"rope_scaling.{field}", "missing")
        value = scaling[field]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise reader.fail(f"rope_scaling.{field}", f"must be a positive number, got {value!r}")
        return float(value)

    original = sub("original_max_position_embeddings")
    if original != int(original):
        raise reader.fail("rope_scaling.original_max_position_embeddings", "must be an integer")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise reader.fail("rope_scaling.truncate", f"expected a boolean, got {truncate!r}")
    return RopeConfig(
        theta=theta,
        factor=sub("factor"),
        beta_fast=sub("beta_fast"),
        beta_slow=sub("beta_slow"),
        original_max_position_embeddings=int(original),
        truncate=truncate,
    )


def _check_consistency(config: ModelConfig, reader: _Reader) -> None:
    for field in ("hidden_size", "intermediate_size"):
        value = getattr(config, field)
        if value % MXFP4_BLOCK_SIZE:
            raise reader.fail(
                field, f"{value} is not a multiple of {MXFP4_BLOCK_SIZE} (the MXFP4 block size)"
            )
    if config.num_attention_heads % config.num_key_value_heads:
        raise reader.fail(
            "num_key_value_heads",
            f"{config.num_key_value_heads} does not divide num_attention_heads "
            f"({config.num_attention_heads})",
        )
    if config.head_dim % 2:
        raise reader.fail("head_dim", f"{config.head_dim} must be even for rotary embeddings")
    if config.num_experts_per_tok > config.num_local_experts:
        raise reader.fail(
            "num_experts_per_tok",
            f"{config.num_experts_per_tok} exceeds num_local_experts ({config.num_local_experts})",
        )
    if reader.raw.get("tie_word_embeddings"):
        raise reader.fail("tie_word_embeddings", "gpt-oss has a separate lm_head; must be false")
    if reader.raw.get("attention_bias") is False:
        raise reader.fail("attention_bias", "gpt-oss attention has biases; must be true")
    quant = reader.raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "mxfp4":
            raise reader.fail(
                "quantization_config.quant_method",
                f"unsupported {method!r} (the experts must be MXFP4, as released)",
            )


# Temperatures below this sample greedily, their limit (as vLLM's _SAMPLING_EPS): logits over
# a temperature of 1e-40 overflow fp32 (the softmax then holds NaN), and far above that the
# draw is the argmax already but for near-exact ties.
GREEDY_BELOW_TEMPERATURE = 1e-5


# The most alternatives a token's log-probabilities come with (the official API's top_logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy, as is any below
    GREEDY_BELOW_TEMPERATURE (stored as 0); ``seed`` makes sampling reproducible.

    Generation stops after a token in ``stop_token_ids`` (which is emitted) or after
    ``max_tokens`` tokens. ``grammar`` (constrained decoding) is the text of the grammar every
    generated token must follow, in the syntax of ``gptoss_serve.constrain``; None: none.

    ``logprobs``: None, or return each token's log-probability with the ``logprobs`` most
    likely tokens at its position (0 to MAX_LOGPROBS): the engines then yield
    ``SampledToken``s. They are the model's own distribution (log-softmax of
    its logits, before temperature, top-p and the grammar's mask), as vLLM's default.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = dataclasses.field(default=None, repr=False)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: normalised once, here


class SampledToken(int):
    """A generated token id with its log-probability and the most likely tokens at its
    position (``top``: (token id, log-probability) pairs, most likely first)."""

    logprob: float  # (an int subclass cannot have __slots__: these live in its __dict__)
    top: tuple[tuple[int, float], ...]

    def __new__(cls, token_id: int, logprob: float, top: tuple[tuple[int, float], ...] = ()):
        token = super().__new__(cls, token_id)
        token.logprob = logprob
        token.top = top
        return token

    def __reduce__(self) -> tuple:  # int's own would rebuild it without its fields
        return SampledToken, (int(self), self.logprob, self.top)


def check_model_id(name: str) -> None:
    """An id the model may be served under (``--served-model-name``): not empty, without
    surrounding spaces. Raises ValueError."""
    if not name or name != name.strip():
        raise ValueError(f"{name!r} is empty or has surrounding spaces")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    store_path: str = ":memory:"  # SQLite file of stored responses
    # Stored responses are deleted this long after they were created (server/retention.py;
    # 30 days, as the official API keeps them; 0: kept for ever), checked at start-up and then
    # every store_prune_interval_s.
    store_retention_s: int = 30 * 86400
    store_prune_interval_s: float = 3600.0
    # Output cap when a request gives no max_output_tokens (None: the rest of the context).
    default_max_output_tokens: int | None = 4096
    reasoning_effort: str = "medium"  # when a request gives none
    # Most tokens of analysis text per reasoning effort, unless a request sets its own
    # `reasoning_budget`; also capped at half the request's output tokens, so that a response
    # never spends all of max_output_tokens reasoning unless it asked to.
    reasoning_budget_low: int = 512
    reasoning_budget_medium: int = 2048
    reasoning_budget_high: int = 8192
    # Largest request body (bytes) read, else 413. A 131k-token context holds at most 16.8 MB
    # of text (o200k's longest token is 128 bytes), JSON-escaped at most ~2x in practice.
    max_request_bytes: int = 64 * 1024 * 1024
    # Worker processes that render large prompts off the event loop (server/render_workers.py;
    # 0: in the server's process, which stalls every stream for the render's duration).
    render_processes: int = 1
    # Keys a /v1 request must send as `Authorization: Bearer KEY` (server/api_keys.py; none:
    # open). Out of the repr, so that logging a config never prints them.
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    # More ids a request's `model` may name, listed by /v1/models after the engine's own
    # (`--served-model-name`); responses carry the engine's.
    model_aliases: tuple[str, ...] = ()
    # Browser origins answered with CORS headers (server/cors.py; none: no CORS, "*": any).
    allowed_origins: tuple[str, ...] = ()
    # Generated tokens of the model's recent messages kept (4 bytes each), which the prompts
    # that send those messages back get as generated (harmony/replay.py: the prefix cache
    # then reaches past a tool loop's calls); 0: prompts are rendered only.
    replay_cache_tokens: int = 1 << 22

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.render_processes < 0:
            raise ValueError("render_processes must be >= 0")
        if self.replay_cache_tokens < 0:
            raise ValueError("replay_cache_tokens must be >= 0")
        if self.store_retention_s < 0 or not self.store_prune_interval_s > 0:
            raise ValueError("store_retention_s must be >= 0, store_prune_interval_s > 0")
        for alias in self.model_aliases:
            try:
                check_model_id(alias)
            except ValueError as error:
                raise ValueError(f"model aliases: {error}") from error
        for effort in ("low", "medium", "high"):
            if self.reasoning_budget(effort) < 0:
                raise ValueError(f"reasoning_budget_{effort} must be >= 0")

    def reasoning_budget(self, effort: str) -> int:
        """The default analysis budget (tokens) of a reasoning effort."""
        return getattr(self, f"reasoning_budget_{effort}")

    def served_model_ids(self, model_name: str) -> tuple[str, ...]:
        """Every id the model is served under: the engine's ``model_name``, then the aliases."""
        return (model_name, *self.model_aliases)


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may hold (engine/scheduler.py)."""

    max_num_seqs: int = 64  # running requests at most: the largest decode batch
    # The token budget of one step, decodes and prefill. 8192 (vLLM's and SGLang's choice on
    # 80 GB GPUs): the MoE's grouped tiles run at 345 against 235 TFLOP/s at 8192 against 2048
    # tokens, so long prompts prefill in fewer, faster steps (120b on the H200: prefill of 8k
    # tokens 25.8k -> 33.3k tok/s, max throughput 8.6k -> 9.5k tok/s, decode figures equal;
    # bench/RESULTS.md e9); a step holding a full chunk then stalls the running decodes longer.
    max_num_batched_tokens: int = 8192
    # The most tokens one request computes in one step (None: the whole budget). A smaller
    # chunk lets several prefills share a step and bounds a sliding layer's blocks per step.
    max_chunk_tokens: int | None = None
    max_model_len: int = 131072  # prompt + output tokens of one request
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one request computes in one step."""
        if self.max_chunk_tokens is None:
            return self.max_num_batched_tokens
        return min(self.max_chunk_tokens, self.max_num_batched_tokens)


# The KV cache's element types (kernels/kv_dtype.py): the activations' own, or FP8 E4M3.
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """The GPU engine (engine/startup.py): its step bounds and how much memory it may take."""

    scheduler: SchedulerConfig = SchedulerConfig()
    # The process may hold this fraction of the device, or this many GB (the smaller if
    # both; 0.9 of the device if neither). The KV cache gets what the weights, activations
    # and CUDA graphs leave under that cap.
    gpu_memory_utilization: float | None = None
    max_gpu_memory_gb: float | None = None
    # An explicit KV cache size in tokens (full-attention layers), instead of measuring the
    # device: for CPU runs and tests.
    kv_cache_tokens: int | None = None
    # Sliding-window blocks beyond what running requests need: they keep freed windows so
    # that prefix-cache hits on sliding layers survive.
    num_spare_sliding_blocks: int = 256
    use_cuda_graphs: bool = True
    # Steps with prefills of up to this many tokens run as piecewise CUDA graphs, the
    # attention eager between them (engine/piecewise_graphs.py; with use_cuda_graphs only;
    # 0: eagerly): issuing such a step eagerly takes the host longer than the device needs.
    piecewise_max_tokens: int = 1024
    # The decode step's kernels as programmatic dependent launches (kernels/launch.py):
    # 2.76 -> 2.59 ms a 120b batch-1 step on the H200 (bench/pdl_step.py).
    programmatic_launch: bool = True
    # Each step launched before the last one's tokens are read back (engine/engine.py), so
    # the device does not wait for the host between steps.
    async_scheduling: bool = True
    # The plain-torch references instead of the Triton kernels (the float32 verification
    # mode; slow, no graphs).
    reference_ops: bool = False
    # "auto": K and V in the activations' dtype; "fp8": E4M3, twice the tokens in the same
    # bytes, at the cost of precision (kernels/kv_dtype.py).
    kv_cache_dtype: str = "auto"
    # Lower scheduler.max_num_seqs to the sequences of 2k tokens the KV cache holds on this
    # GPU, never below 64 (engine/seats.py; `--max-num-seqs auto`).
    fit_max_num_seqs: bool = False

    def __post_init__(self) -> None:
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        if self.max_gpu_memory_gb is not None and self.max_gpu_memory_gb <= 0:
            raise ValueError(f"max_gpu_memory_gb must be > 0, got {self.max_gpu_memory_gb}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.piecewise_max_tokens < 0:
            raise ValueError(f"piecewise_max_tokens must be >= 0, got {self.piecewise_max_tokens}")
        if self.num_spare_sliding_blocks < 0:
            raise ValueError("num_spare_sliding_blocks must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
