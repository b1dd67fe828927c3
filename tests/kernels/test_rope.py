"""rope_and_cache_write: the reference against apply_rope and a cache gather (CPU), the Triton
kernel against the reference (interpreter on CPU, gpt-oss shapes on the GPU), with q/k/v as
views of a poisoned fused qkv buffer, a poisoned output and cache, and skipped -1 slots."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from compare import assert_close, poisoned

from gptoss_serve.config import RopeConfig
from gptoss_serve.kernels.rope import (
    apply_rope,
    rope_and_cache_write,
    rope_and_cache_write_reference,
    rope_cos_sin,
)
from gptoss_serve.model.rope import yarn_inv_freq

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
not_interpreted = pytest.mark.skipif(INTERPRETING, reason="real shapes: too slow to interpret")
GPT_OSS_ROPE = RopeConfig(
    theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
    original_max_position_embeddings=4096, truncate=False,
)  # fmt: skip
# float32: FMA contraction and trig ulps only. bf16 on the GPU: a rare output rounding flips.
TOLERANCE = {
    torch.float32: dict(max_rel=2e-6, rms_rel=5e-7),
    torch.bfloat16: dict(max_rel=8e-3, rms_rel=1e-3),
}
# The interpreter rounds float32 -> bf16 toward zero: every output may be off by up to an ulp.
INTERPRETER_BF16 = dict(max_rel=1.6e-2, rms_rel=1.2e-2)


def _tolerance(dtype: torch.dtype, device: str) -> dict[str, float]:
    return INTERPRETER_BF16 if dtype == torch.bfloat16 and device == "cpu" else TOLERANCE[dtype]


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, pad: int = 5):
    """shape (T, A, KV, D) -> q, k, v as views of one NaN-padded [T, (A + 2 KV) · D + pad]
    qkv buffer, YaRN inv_freq, positions up to 131072, a NaN cache [blocks, 2, 16, KV, D] (K and
    V interleaved per block) and a slot mapping with distinct slots and every fourth one -1."""
    tokens, heads, kv_heads, head_dim = shape
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv = poisoned((tokens, q_dim + 2 * kv_dim + pad), dtype, device)
    qkv[:, : q_dim + 2 * kv_dim] = torch.randn(tokens, q_dim + 2 * kv_dim, device=device)
    q = qkv[:, :q_dim].view(tokens, heads, head_dim)
    k = qkv[:, q_dim : q_dim + kv_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_dim + kv_dim : q_dim + 2 * kv_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 131072, (tokens,), device=device)
    inv_freq = yarn_inv_freq(head_dim, GPT_OSS_ROPE).to(device)
    num_blocks = tokens // 8 + 2
    cache = poisoned((num_blocks, 2, 16, kv_heads, head_dim), dtype, device)
    slots = torch.randperm(num_blocks * 16, device=device)[:tokens]
    slots[1::4] = -1  # padded tokens of a CUDA-graph batch; token 0 is always written
    return q, k, v, positions, inv_freq, cache, slots


def _written(cache: torch.Tensor, slots: torch.Tensor, kv: int) -> torch.Tensor:
    """cache [blocks, 2, 16, KV, D] -> the K (kv=0) or V (kv=1) rows at slots [N]."""
    return cache[slots // 16, kv, slots % 16]


def test_reference_rotates_and_writes_only_its_slots() -> None:
    q, k, v, positions, inv_freq, cache, slots = _case((9, 4, 2, 16), torch.float32, "cpu")
    scaling = GPT_OSS_ROPE.attention_scaling
    q_rotated = rope_and_cache_write_reference(
        q, k, v, positions, inv_freq, scaling, cache[:, 0], cache[:, 1], slots
    )
    cos, sin = rope_cos_sin(positions, inv_freq, scaling)
    assert torch.equal(q_rotated, apply_rope(q, cos, sin))
    written = slots >= 0
    assert torch.equal(_written(cache, slots[written], 0), apply_rope(k, cos, sin)[written])
    assert torch.equal(_written(cache, slots[written], 1), v[written])
    assert int(cache.isfinite().all(-1).all(-1).sum()) == 2 * int(written.sum())


def test_cpu_dispatch_is_the_reference() -> None:
    q, k, v, positions, inv_freq, cache, slots = _case((6, 4, 2, 16), torch.bfloat16, "cpu")
    expected_cache = cache.clone()
    args = (q, k, v, positions, inv_freq, 1.3)
    actual = rope_and_cache_write(*args, cache[:, 0], cache[:, 1], slots)
    expected = rope_and_cache_write_reference(
        *args, expected_cache[:, 0], expected_cache[:, 1], slots
    )
    assert torch.equal(actual, expected)
    assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())
    with pytest.raises(ValueError):
        rope_and_cache_write(*args, cache[:, 0, :, :1], cache[:, 1], slots)


def _check_kernel(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> None:
    rope_and_cache_write_triton = pytest.importorskip(
        "gptoss_serve.kernels._rope"
    ).rope_and_cache_write_triton
    q, k, v, positions, inv_freq, cache, slots = _case(shape, dtype, device)
    tokens, heads, _, head_dim = shape
    scaling = GPT_OSS_ROPE.attention_scaling
    expected_cache = cache.clone()
    expected = rope_and_cache_write_reference(
        q, k, v, positions, inv_freq, scaling, expected_cache[:, 0], expected_cache[:, 1], slots
    )
    # The output is a NaN view with a padded head stride: stray writes stay visible.
    out_buffer = poisoned((tokens, heads, head_dim + 3), dtype, device)
    out = out_buffer[..., :head_dim]
    actual = rope_and_cache_write_triton(
        q, k, v, positions, inv_freq, scaling, cache[:, 0], cache[:, 1], slots, out=out
    )
    assert actual is out and out_buffer[..., head_dim:].isnan().all()
    assert_close(actual, expected, **_tolerance(dtype, device))
    # Slots that must not be written stay poisoned, slot -1 rows are skipped, V is copied.
    assert torch.equal(cache.isnan(), expected_cache.isnan())
    written = slots[slots >= 0]
    assert_close(
        _written(cache, written, 0),
        _written(expected_cache, written, 0),
        **_tolerance(dtype, device),
    )
    assert torch.equal(_written(cache, written, 1), _written(expected_cache, written, 1))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 5, 3, 12), (4, 8, 1, 64), (1, 3, 3, 6)])
def test_kernel_interpreted(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    _check_kernel(shape, dtype, "cpu")


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_kernel_gpu(tokens: int, dtype: torch.dtype) -> None:
    _check_kernel((tokens, 64, 8, 64), dtype, "cuda")


@pytest.mark.gpu
@not_interpreted
def test_gpu_dispatch() -> None:
    q, k, v, positions, inv_freq, cache, slots = _case((33, 64, 8, 64), torch.bfloat16, "cuda")
    expected_cache = cache.clone()
    args = (q, k, v, positions, inv_freq, GPT_OSS_ROPE.attention_scaling)
    actual = rope_and_cache_write(*args, cache[:, 0], cache[:, 1], slots)
    expected = rope_and_cache_write_reference(
        *args, expected_cache[:, 0], expected_cache[:, 1], slots
    )
    assert_close(actual, expected, **TOLERANCE[torch.bfloat16])
    assert torch.equal(cache.isnan(), expected_cache.isnan())
