"""kv_dtype: which cache dtype a setting names, and how values are rounded into an FP8 cache."""

from __future__ import annotations

import pytest
import torch

from gptoss_serve.config import EngineConfig
from gptoss_serve.kernels.kv_dtype import FP8, cache_dtype, check_cache, to_cache


def test_cache_dtype_follows_the_setting() -> None:
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("auto", torch.float32) == torch.float32
    assert cache_dtype("fp8", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="bf16 activations"):
        cache_dtype("fp8", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        cache_dtype("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")


def test_to_cache_rounds_through_bf16_saturates_and_keeps_zeros() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, 1.05, 1.07, 300.0, 500.0, -1e6, 2.0**-9, 2.0**-11])
    stored = to_cache(x, FP8).float()
    # E4M3 near 1 is in steps of 1/8: 1.05 rounds down, 1.07 up; past ±448 saturates;
    # 2^-9 is the smallest subnormal, 2^-11 rounds to zero.
    expected = [0.0, -0.0, 1.0, 1.0, 1.125, 288.0, 448.0, -448.0, 2.0**-9, 0.0]
    assert stored.tolist() == expected
    assert torch.equal(stored.signbit(), torch.tensor(expected).signbit())
    # The bf16 rounding comes first, as in the model: 1.0626 is 1.0625 in bf16, a tie that
    # goes to the even code 1.0 (from float32 directly it would round up to 1.125).
    assert to_cache(torch.tensor([1.0626]), FP8).float().item() == 1.0
    assert torch.tensor([1.0626]).to(FP8).float().item() == 1.125
    assert to_cache(x, torch.bfloat16).dtype == torch.bfloat16


def test_check_cache_takes_the_activations_dtype_or_fp8_under_bf16() -> None:
    check_cache(torch.bfloat16, torch.bfloat16)
    check_cache(FP8, torch.bfloat16)
    check_cache(torch.float32, torch.float32)
    for cache, activations in ((FP8, torch.float32), (torch.float16, torch.bfloat16)):
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            check_cache(cache, activations)
