"""KV cache sizing with the real gpt-oss configs: pure arithmetic, no device."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gptoss_serve.checkpoint.layout import expected_tensors
from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.kv_sizing import (
    GIB,
    KvCacheSizeError,
    KvCacheSpec,
    kv_cache_bytes,
    plan_kv_cache,
    seqs_that_fit,
)

DATA = Path(__file__).resolve().parents[1] / "data"
GB = 10**9


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_file(DATA / f"gpt-oss-{name}.config.json")


def _weight_bytes(config: ModelConfig) -> int:
    """The checkpoint as loaded: MXFP4 experts (U8) and everything else in bf16."""
    sizes = {"BF16": 2, "U8": 1}
    return sum(math.prod(t.shape) * sizes[t.dtype] for t in expected_tensors(config).values())


def test_spec_of_120b_matches_the_model_facts() -> None:
    spec = KvCacheSpec.from_model_config(_model("120b"))
    assert (spec.num_full_layers, spec.num_sliding_layers) == (18, 18)
    assert spec.layer_token_bytes == 2048  # bf16 K and V, 8 KV heads x 64
    # docs/performance.md: about 37 KB per token of context (the full layers only).
    assert spec.full_block_bytes == 18 * 16 * 2048 == 36_864 * 16
    assert spec.sliding_block_bytes == spec.full_block_bytes


@pytest.mark.parametrize(
    ("name", "cap_bytes", "weights_gb"), [("120b", 80 * GB, (61, 66)), ("20b", 24 * GB, (13, 14))]
)
def test_a_128k_context_fits_under_the_cap(name: str, cap_bytes: int, weights_gb: tuple) -> None:
    config = _model(name)
    weights = _weight_bytes(config)
    assert weights_gb[0] * GB < weights < weights_gb[1] * GB
    # On an H200 (141 GB) capped at cap_bytes; the process holds the weights plus 2 GiB
    # (CUDA context, allocator slack) and keeps 4 GiB for activations and CUDA graphs.
    used = weights + 2 * GIB
    budget = kv_cache_bytes(
        total_bytes=141 * GB,
        free_bytes=141 * GB - used,
        used_bytes=used,
        max_gpu_memory_bytes=cap_bytes,
        reserve_bytes=4 * GIB,
    )
    assert budget == cap_bytes - used - 4 * GIB
    spec = KvCacheSpec.from_model_config(config)
    plan = plan_kv_cache(spec, budget, max_num_seqs=64, max_num_batched_tokens=2048)
    assert plan.max_num_tokens >= 131072
    assert plan.num_bytes <= budget < plan.num_bytes + spec.full_block_bytes
    # The sliding layers take only their windows: 64 x 9 blocks + the chunk spread.
    assert plan.num_sliding_blocks == 64 * 9 + (2048 + 15 * 64) // 16
    assert plan.num_sliding_blocks * spec.sliding_block_bytes < 0.5 * GB


def test_120b_numbers() -> None:
    spec = KvCacheSpec.from_model_config(_model("120b"))
    plan = plan_kv_cache(spec, 10 * GIB, max_num_seqs=128, max_num_batched_tokens=8192)
    assert plan.num_sliding_blocks == 128 * 9 + (8192 + 15 * 128) // 16 == 1784
    assert plan.num_full_blocks == (10 * GIB - 1784 * 589_824) // 589_824 == 16420
    assert plan.max_num_tokens == 262_720


def test_the_smaller_cap_wins_and_free_memory_bounds_it() -> None:
    common = dict(total_bytes=100 * GB, used_bytes=60 * GB)
    assert kv_cache_bytes(free_bytes=40 * GB, **common) == 30 * GB  # default 0.9
    assert kv_cache_bytes(free_bytes=40 * GB, gpu_memory_utilization=0.95, **common) == 35 * GB
    assert kv_cache_bytes(free_bytes=40 * GB, max_gpu_memory_bytes=70 * GB, **common) == 10 * GB
    both = kv_cache_bytes(
        free_bytes=40 * GB, gpu_memory_utilization=0.95, max_gpu_memory_bytes=99 * GB, **common
    )
    assert both == 35 * GB
    # Another process holds memory: free memory, not the cap, is the limit.
    assert kv_cache_bytes(free_bytes=5 * GB, **common) == 5 * GB
    with pytest.raises(KvCacheSizeError, match="no memory left for the KV cache"):
        kv_cache_bytes(free_bytes=40 * GB, max_gpu_memory_bytes=60 * GB, **common)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(free_bytes=40 * GB, gpu_memory_utilization=1.5, **common)


def test_too_little_memory_for_one_full_block_is_an_error() -> None:
    spec = KvCacheSpec.from_model_config(_model("120b"))
    with pytest.raises(KvCacheSizeError, match="sliding-window layers take"):
        plan_kv_cache(spec, 100 * 2**20, max_num_seqs=256, max_num_batched_tokens=8192)


def test_seqs_that_fit_is_the_largest_count_whose_plan_holds_them() -> None:
    """An 80 GB card's KV budget for 120b (~6 GiB): 1024 sequences' sliding windows leave room
    for fewer than two sequences of 2048 tokens (5.5 GiB: not one block), while the count
    seqs_that_fit gives plans a cache holding that many, and one more does not fit."""
    spec = KvCacheSpec.from_model_config(_model("120b"))
    budget, tokens, chunk = 6 * GIB, 2048, 8192
    crowded = plan_kv_cache(spec, budget, max_num_seqs=1024, max_num_batched_tokens=chunk)
    assert crowded.max_num_tokens < 2 * tokens
    with pytest.raises(KvCacheSizeError, match="sliding-window layers take"):
        plan_kv_cache(spec, int(5.5 * GIB), max_num_seqs=1024, max_num_batched_tokens=chunk)
    fit = seqs_that_fit(spec, budget, tokens_per_seq=tokens, max_num_batched_tokens=chunk)
    # Per sequence: 128 full blocks + 9 sliding ones (+ one block of chunk spread) of 576 KiB.
    assert 70 < fit < budget // (137 * spec.full_block_bytes)
    for seqs, fits in ((fit, True), (fit + 1, False)):
        plan = plan_kv_cache(spec, budget, max_num_seqs=seqs, max_num_batched_tokens=chunk)
        assert (plan.max_num_tokens >= seqs * tokens) is fits
    spares = seqs_that_fit(spec, budget, tokens_per_seq=tokens, max_num_batched_tokens=chunk,
                           num_spare_sliding_blocks=2000)  # fmt: skip
    assert spares < fit
    assert seqs_that_fit(spec, 2**20, tokens_per_seq=tokens, max_num_batched_tokens=chunk) == 0
    with pytest.raises(ValueError, match="tokens_per_seq"):
        seqs_that_fit(spec, budget, tokens_per_seq=0, max_num_batched_tokens=chunk)
