"""The one comparator every kernel test uses: max and RMS error relative to the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Comparison:
    max_abs: float  # max |actual - expected|
    max_rel: float  # max_abs / max |expected|
    rms_rel: float  # rms(actual - expected) / rms(expected)

    def __str__(self) -> str:
        return f"max_abs={self.max_abs:.3e} max_rel={self.max_rel:.3e} rms_rel={self.rms_rel:.3e}"


def compare(actual: torch.Tensor, expected: torch.Tensor) -> Comparison:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in the kernel output"
    diff = a - e
    scale = e.abs().max().item() or 1.0
    rms = e.pow(2).mean().sqrt().item() or 1.0
    return Comparison(
        max_abs=diff.abs().max().item(),
        max_rel=diff.abs().max().item() / scale,
        rms_rel=diff.pow(2).mean().sqrt().item() / rms,
    )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, max_rel: float, rms_rel: float
) -> Comparison:
    """Fail with both errors in the message when either bound is exceeded."""
    result = compare(actual, expected)
    assert result.max_rel <= max_rel and result.rms_rel <= rms_rel, str(result)
    return result


def poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, *, fill: float = float("nan")
):
    """A buffer pre-filled with NaN (or a byte pattern for integer dtypes): any read of padding
    a kernel should not touch, or any output it forgot to write, shows up as non-finite."""
    if dtype.is_floating_point:
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.full(shape, 0xAB, dtype=dtype, device=device)


def assert_fp8_near(actual: torch.Tensor, expected: torch.Tensor, *, max_mismatch: float) -> float:
    """Two FP8 (E4M3) tensors that differ at most by one code step where they differ, at no more
    than ``max_mismatch`` of the elements (a kernel's fp32 sums may round its bf16 value, and so
    the FP8 one, to the other side of a boundary). NaN (poison) only where the other has NaN.
    Returns the fraction that differs."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.view(torch.uint8).int().cpu(), expected.view(torch.uint8).int().cpu()
    assert torch.equal(actual.isnan().cpu(), expected.isnan().cpu()), "NaN in other places"
    # Sign-magnitude codes in order: -m below 0 for negatives (both zeros are 0).
    order_a = torch.where(a >= 128, -(a & 0x7F), a)
    order_e = torch.where(e >= 128, -(e & 0x7F), e)
    steps = (order_a - order_e).abs()
    assert int(steps.max()) <= 1, f"codes {int(steps.max())} steps apart"
    mismatch = float((steps > 0).float().mean())
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of the codes differ"
    return mismatch
