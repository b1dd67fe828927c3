"""fused_add_rms_norm: the reference against rms_norm (CPU), the Triton kernel against the
reference (interpreter on CPU, real shapes on the GPU), with poisoned padding and outputs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from compare import assert_close, poisoned

from gptoss_serve.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
not_interpreted = pytest.mark.skipif(INTERPRETING, reason="real shapes: too slow to interpret")
EPS = 1e-5
# float32: reduction order and rsqrt.approx only. bf16 on the GPU: a rare output rounding flips.
TOLERANCE = {
    torch.float32: dict(max_rel=1e-5, rms_rel=1e-6),
    torch.bfloat16: dict(max_rel=8e-3, rms_rel=1e-3),
}
# The interpreter rounds float32 -> bf16 toward zero: every output may be off by up to an ulp.
INTERPRETER_BF16 = dict(max_rel=1.6e-2, rms_rel=1.2e-2)


def _tolerance(dtype: torch.dtype, device: str) -> dict[str, float]:
    return INTERPRETER_BF16 if dtype == torch.bfloat16 and device == "cpu" else TOLERANCE[dtype]


def _padded(data: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """data [T, H] copied into a view of a NaN-filled [T, H + pad] buffer: a stray read or
    write of the padding shows up. Returns (view, buffer)."""
    buffer = poisoned((data.shape[0], data.shape[1] + pad), data.dtype, str(data.device))
    buffer[:, : data.shape[1]] = data
    return buffer[:, : data.shape[1]], buffer


def _inputs(num_tokens: int, hidden: int, dtype: torch.dtype, device: str):
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    residual = (torch.randn(num_tokens, hidden, device=device) * 4).to(dtype)
    weight = torch.rand(hidden, device=device) + 0.5
    return x, residual, weight


def test_reference_is_add_then_rms_norm() -> None:
    x, residual, weight = _inputs(5, 96, torch.bfloat16, "cpu")
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, rms_norm(x + residual, weight, EPS))
    normed, new_residual = fused_add_rms_norm_reference(x, None, weight, EPS)
    assert torch.equal(new_residual, x) and new_residual.data_ptr() != x.data_ptr()
    assert torch.equal(normed, rms_norm(x, weight, EPS))


def test_cpu_dispatch_is_the_reference() -> None:
    x, residual, weight = _inputs(3, 200, torch.float32, "cpu")
    for actual, expected in zip(
        fused_add_rms_norm(x, residual, weight, EPS),
        fused_add_rms_norm_reference(x, residual, weight, EPS),
        strict=True,
    ):
        assert torch.equal(actual, expected)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, residual[:, :-1], weight, EPS)


def _check_kernel(
    num_tokens: int, hidden: int, dtype: torch.dtype, has_residual: bool, device: str
) -> None:
    fused_add_rms_norm_triton = pytest.importorskip(
        "gptoss_serve.kernels._norm"
    ).fused_add_rms_norm_triton
    x, residual, weight = _inputs(num_tokens, hidden, dtype, device)
    residual = residual if has_residual else None
    expected = fused_add_rms_norm_reference(x, residual, weight, EPS)
    # Inputs and outputs are views into NaN-poisoned wider buffers; the outputs are NaN too.
    normed, normed_buffer = _padded(poisoned((num_tokens, hidden), dtype, device), 19)
    new_residual, residual_buffer = _padded(poisoned((num_tokens, hidden), dtype, device), 3)
    actual = fused_add_rms_norm_triton(
        _padded(x, 37)[0],
        None if residual is None else _padded(residual, 5)[0],
        _padded(weight[None], 11)[0][0],
        EPS,
        out=(normed, new_residual),
    )
    assert actual[0] is normed and actual[1] is new_residual
    for got, want, buffer in zip(actual, expected, (normed_buffer, residual_buffer), strict=True):
        assert_close(got, want, **_tolerance(dtype, device))
        assert buffer[:, hidden:].isnan().all(), "wrote past the row"


@interpreter
@pytest.mark.parametrize("hidden", [96, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_residual", [True, False])
def test_kernel_interpreted(hidden: int, dtype: torch.dtype, has_residual: bool) -> None:
    _check_kernel(5, hidden, dtype, has_residual, "cpu")


@interpreter
def test_kernel_in_place_interpreted() -> None:
    """out = (x, residual): the engine may update its residual stream in place."""
    fused_add_rms_norm_triton = pytest.importorskip(
        "gptoss_serve.kernels._norm"
    ).fused_add_rms_norm_triton
    x, residual, weight = _inputs(4, 96, torch.float32, "cpu")
    expected = fused_add_rms_norm_reference(x, residual, weight, EPS)
    fused_add_rms_norm_triton(x, residual, weight, EPS, out=(x, residual))
    assert_close(x, expected[0], **TOLERANCE[torch.float32])
    assert_close(residual, expected[1], **TOLERANCE[torch.float32])


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_residual", [True, False])
def test_kernel_gpu(num_tokens: int, dtype: torch.dtype, has_residual: bool) -> None:
    _check_kernel(num_tokens, 2880, dtype, has_residual, "cuda")


@pytest.mark.gpu
@not_interpreted
def test_gpu_dispatch_and_exact_residual() -> None:
    x, residual, weight = _inputs(300, 2880, torch.bfloat16, "cuda")
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    # The same float32 sum rounded to nearest: bit for bit.
    assert torch.equal(new_residual, expected_residual)
    assert_close(normed, expected_normed, **TOLERANCE[torch.bfloat16])
