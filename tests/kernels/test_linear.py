"""The dense projection's Triton kernels (kernels/linear.py: the GEMV up to GEMV_MAX_TOKENS, the
tensor-core kernel up to MMA_MAX_TOKENS) against torch's linear in float32, on odd shapes with
poisoned padding: rows past the weight's end and columns past each activation row are NaN."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from compare import assert_close

from gptoss_serve.kernels.linear import (
    GEMV_MAX_TOKENS,
    GEMV_TILES,
    GEMV_TILES_TALL,
    GEMV_TILES_WIDE,
    GEMV_TILES_WIDE_PAIR,
    MMA_MAX_TOKENS,
    GemvTiles,
    MmaTiles,
    gemv_tiles_for,
    linear,
    linear_reference,
    mma_applies,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
not_interpreted = pytest.mark.skipif(INTERPRETING, reason="real shapes: too slow to interpret")
# Against the float32 product of the same bf16 inputs: bf16 outputs carry one rounding
# (2^-9 relative), float32 ones only the summation order.
TOLERANCE = {
    torch.bfloat16: dict(max_rel=8e-3, rms_rel=3e-3),
    torch.float32: dict(max_rel=1e-4, rms_rel=1e-5),
}


def _inputs(num_tokens: int, num_rows: int, k: int, device: str, *, has_bias: bool = True):
    """x [T, K] as a view with a NaN tail on every row; weight [N, K] as the first N rows of a
    buffer whose next row is NaN (a program that reads past the end poisons its output)."""
    x_buffer = torch.full((num_tokens, k + 13), float("nan"), device=device)
    x_buffer[:, :k] = torch.randn(num_tokens, k, device=device)
    w_buffer = torch.full((num_rows + 1, k), float("nan"), device=device)
    w_buffer[:num_rows] = torch.randn(num_rows, k, device=device) * k**-0.5
    x = x_buffer.to(torch.bfloat16)[:, :k]
    weight = w_buffer.to(torch.bfloat16)[:num_rows]
    bias = torch.randn(num_rows, device=device).to(torch.bfloat16) if has_bias else None
    return x, weight, bias


def _expected(x, weight, bias) -> torch.Tensor:
    return linear_reference(x.float(), weight.float(), None if bias is None else bias.float())


def _check(num_tokens, num_rows, k, device, out_dtype, *, has_bias=True, tiles=None) -> None:
    """The GEMV, or with MmaTiles the tensor-core kernel."""
    from gptoss_serve.kernels._linear import linear_triton  # noqa: PLC0415 (needs triton)
    from gptoss_serve.kernels._linear_mma import linear_mma_triton  # noqa: PLC0415

    x, weight, bias = _inputs(num_tokens, num_rows, k, device, has_bias=has_bias)
    if isinstance(tiles, MmaTiles):
        actual = linear_mma_triton(x, weight, bias, out_dtype, tiles)
    else:
        actual = linear_triton(x, weight, bias, out_dtype, tiles or GemvTiles())
    assert actual.dtype == out_dtype and actual.shape == (num_tokens, num_rows)
    assert_close(actual, _expected(x, weight, bias), **TOLERANCE[out_dtype])


def test_reference_and_cpu_dispatch() -> None:
    x, weight, bias = _inputs(3, 37, 200, "cpu")
    expected = torch.nn.functional.linear(x, weight, bias)
    assert torch.equal(linear(x, weight, bias), expected)
    assert linear(x, weight, bias, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="expected x"):
        linear(x, weight[:, :-1], bias)
    with pytest.raises(ValueError, match="bias"):
        linear(x, weight, bias[:-1])


@interpreter
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles", [GemvTiles(4, 4), GemvTiles(1, 1)], ids=["4x4", "1x1"])
def test_gemv_interpreted(num_tokens: int, out_dtype: torch.dtype, tiles: GemvTiles) -> None:
    _check(num_tokens, 37, 200, "cpu", out_dtype, tiles=tiles)  # 37 rows: a ragged last tile
    _check(num_tokens, 16, 128, "cpu", out_dtype, has_bias=False, tiles=tiles)  # K == K_PAD


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
@pytest.mark.parametrize(
    ("num_rows", "k"), [(5120, 2880), (2880, 4096), (50021, 2880)], ids=["qkv", "o", "lm_head"]
)
def test_gemv_gpu(num_tokens: int, num_rows: int, k: int) -> None:
    for out_dtype in (torch.bfloat16, torch.float32):
        _check(num_tokens, num_rows, k, "cuda", out_dtype)


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize(
    "tiles", [GemvTiles(r, w) for r, w in [(1, 4), (1, 8), (2, 8), (8, 4), (8, 8)]]
)
def test_gemv_gpu_tiles(tiles: GemvTiles) -> None:
    _check(2, 5121, 2880, "cuda", torch.float32, tiles=tiles)


@interpreter
@pytest.mark.parametrize("num_tokens", [3, 17])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_mma_interpreted(num_tokens: int, out_dtype: torch.dtype) -> None:
    """Ragged rows (37 of 16-row tiles) and K (200: a masked last step of 64 columns); 17
    tokens: 32 MMA columns, 15 of them padding."""
    tiles = MmaTiles(rows=16, block_k=64, num_stages=2, num_warps=4)
    _check(num_tokens, 37, 200, "cpu", out_dtype, tiles=tiles)
    _check(num_tokens, 16, 128, "cpu", out_dtype, has_bias=False, tiles=tiles)


def test_gemv_tiles_by_projection() -> None:
    """q/k/v, o and the unembedding of both model sizes each take their own row; o its own at
    2 tokens."""
    for num_tokens in (1, 2):
        assert gemv_tiles_for(5120, 2880, num_tokens) == GEMV_TILES
        assert gemv_tiles_for(201088, 2880, num_tokens) == GEMV_TILES_TALL
    assert gemv_tiles_for(2880, 4096) == gemv_tiles_for(2880, 4096, 1) == GEMV_TILES_WIDE
    assert gemv_tiles_for(2880, 4096, 2) == GEMV_TILES_WIDE_PAIR
    assert len({GEMV_TILES, GEMV_TILES_WIDE, GEMV_TILES_WIDE_PAIR}) == 3


def test_mma_takes_the_tokens_between_the_gemv_and_cublas() -> None:
    x = torch.zeros(MMA_MAX_TOKENS + 1, 64, dtype=torch.bfloat16)
    weight = torch.zeros(32, 64, dtype=torch.bfloat16)
    taken = [n for n in range(1, MMA_MAX_TOKENS + 2) if mma_applies(x[:n], weight, x.dtype)]
    assert taken == list(range(GEMV_MAX_TOKENS + 1, MMA_MAX_TOKENS + 1))
    assert not mma_applies(x[:3].float(), weight.float(), torch.float32)


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("num_tokens", [3, 8, 16])
@pytest.mark.parametrize(
    ("num_rows", "k"), [(5120, 2880), (2880, 4096), (50021, 2880)], ids=["qkv", "o", "lm_head"]
)
def test_mma_gpu(num_tokens: int, num_rows: int, k: int) -> None:
    for out_dtype in (torch.bfloat16, torch.float32):
        _check(num_tokens, num_rows, k, "cuda", out_dtype, tiles=MmaTiles())
        _check(num_tokens, num_rows, k, "cuda", out_dtype, tiles=MmaTiles(rows=16, num_stages=3))


@pytest.mark.gpu
@not_interpreted
def test_gpu_dispatch() -> None:
    """Up to GEMV_MAX_TOKENS the GEMV, then the tensor-core kernel, past MMA_MAX_TOKENS cuBLAS:
    all agree with the float32 product."""
    for num_tokens in (1, GEMV_MAX_TOKENS + 1, MMA_MAX_TOKENS, MMA_MAX_TOKENS + 1):
        x, weight, bias = _inputs(num_tokens, 999, 2880, "cuda")
        assert_close(
            linear(x, weight, bias), _expected(x, weight, bias), **TOLERANCE[torch.bfloat16]
        )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU")
def test_mma_kernel_builds_a_pipelined_wgmma_for_sm90() -> None:
    """The table's tiles (sm_90 build, 120b q/k/v shape, 16 token columns): the weight stream
    goes through cp.async, the MMA is wgmma, nothing spills, and x is read only after the PDL
    wait."""
    from moe_cases import compile_sm90  # noqa: PLC0415

    from gptoss_serve.kernels import _linear_mma  # noqa: PLC0415
    from gptoss_serve.kernels.linear import MMA_TILES  # noqa: PLC0415

    constexprs = dict(K=2880, BM=MMA_TILES.rows, BK=MMA_TILES.block_k, T_PAD=16, HAS_BIAS=True,
                      OUT_FP32=False, PDL=True, NUM_STAGES=MMA_TILES.num_stages,
                      INTERPRET=False)  # fmt: skip
    pointers = {name: "*bf16" for name in ("x_ptr", "weight_ptr", "bias_ptr", "out_ptr")}
    ptx = compile_sm90(_linear_mma._linear_mma_kernel, constexprs, pointers,
                       dict(num_warps=MMA_TILES.num_warps))  # fmt: skip
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert "ld.global" not in before and "cp.async" not in before
    assert "cp.async" in after and "wgmma" in after
    assert ".local" not in ptx
