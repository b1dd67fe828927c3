"""rope_and_cache_write: the reference against apply_rope and a cache gather (CPU), the Triton
kernel against the reference (interpreter on CPU, gpt-oss shapes on the GPU), with q/k/v as
views of a poisoned fused qkv buffer, a poisoned output and cache, and skipped -1 slots.
qkv_rope_and_cache_write: its reference against the projection then the above, the fused
q/k/v GEMV kernel against the reference (interpreter, gpt-oss shapes on the GPU) and the op
against the unfused kernels on the GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from compare import assert_close, assert_fp8_near, poisoned

from gptoss_serve.config import RopeConfig
from gptoss_serve.kernels.kv_dtype import FP8, to_cache
from gptoss_serve.kernels.linear import GEMV_MAX_TOKENS, linear
from gptoss_serve.kernels.rope import (
    QKV_MMA_MAX_TOKENS,
    apply_rope,
    qkv_rope_and_cache_write,
    qkv_rope_and_cache_write_reference,
    rope_and_cache_write,
    rope_and_cache_write_reference,
    rope_cos_sin,
    rope_cos_sin_table,
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


def _case(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    pad: int = 5,
    cache_dtype: torch.dtype | None = None,
):
    """shape (T, A, KV, D) -> q, k, v as views of one NaN-padded [T, (A + 2 KV) · D + pad]
    qkv buffer, YaRN inv_freq, positions up to 131072, a NaN cache [blocks, 2, 16, KV, D] (K and
    V interleaved per block; ``cache_dtype``, default ``dtype``) and a slot mapping with
    distinct slots and every fourth one -1."""
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
    cache = poisoned((num_blocks, 2, 16, kv_heads, head_dim), cache_dtype or dtype, device)
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


def test_reference_writes_an_fp8_cache_as_to_cache_rounds_the_bf16_one() -> None:
    """An FP8 cache holds the bf16 cache's values saturated and rounded (kv_dtype.to_cache);
    q is unchanged; an FP8 cache under float32 activations is refused."""
    q, k, v, positions, inv_freq, cache, slots = _case((9, 4, 2, 16), torch.bfloat16, "cpu")
    k.mul_(300.0)  # some keys past ±448 after the rotation: saturated, not NaN
    fp8_cache = poisoned(cache.shape, FP8, "cpu")
    args = (q, k, v, positions, inv_freq, 1.3)
    expected = rope_and_cache_write_reference(*args, cache[:, 0], cache[:, 1], slots)
    actual = rope_and_cache_write(*args, fp8_cache[:, 0], fp8_cache[:, 1], slots)
    assert torch.equal(actual, expected)
    written = slots[slots >= 0]
    for kv in (0, 1):
        rows = _written(fp8_cache, written, kv)
        assert torch.equal(
            rows.view(torch.uint8), to_cache(_written(cache, written, kv), FP8).view(torch.uint8)
        )
    assert int(fp8_cache.isnan().logical_not().sum()) == int(cache.isfinite().sum())
    assert _written(fp8_cache, written, 0).float().abs().max() == 448.0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rope_and_cache_write(q.float(), k.float(), v.float(), positions, inv_freq, 1.3,
                             fp8_cache[:, 0], fp8_cache[:, 1], slots)  # fmt: skip


def _check_cache_rows(cache, expected_cache, slots, tolerance, *, exact_v: bool) -> None:
    """Slots that must not be written stay poisoned, slot -1 rows are skipped; K within the
    tolerance (an FP8 cache: at most one code step at 1% of the elements), V as said."""
    assert torch.equal(cache.isnan(), expected_cache.isnan())
    written = slots[slots >= 0]
    for kv in (0, 1):
        actual, expected = _written(cache, written, kv), _written(expected_cache, written, kv)
        if kv == 1 and exact_v:
            assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        elif cache.dtype == FP8:
            assert_fp8_near(actual, expected, max_mismatch=0.01)
        else:
            assert_close(actual, expected, **tolerance)


def _check_kernel(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    rope_and_cache_write_triton = pytest.importorskip(
        "gptoss_serve.kernels._rope"
    ).rope_and_cache_write_triton
    q, k, v, positions, inv_freq, cache, slots = _case(
        shape, dtype, device, cache_dtype=cache_dtype
    )
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
    _check_cache_rows(cache, expected_cache, slots, _tolerance(dtype, device), exact_v=True)


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
@pytest.mark.parametrize("tokens", [1, 300])
def test_kernel_gpu_fp8_cache(tokens: int) -> None:
    """(Not in the interpreter: Triton 3.6's interpreter rounds float -> FP8 wrongly.)"""
    _check_kernel((tokens, 64, 8, 64), torch.bfloat16, "cuda", cache_dtype=FP8)


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


def _qkv_case(
    shape: tuple[int, int, int, int, int], device: str, cache_dtype: torch.dtype | None = None
):
    """shape (T, A, KV, D, H) -> bf16 x [T, H], the q/k/v weight and bias, and the rest of
    ``_case`` (positions, inv_freq, NaN cache, slots with -1s)."""
    tokens, heads, kv_heads, head_dim, hidden = shape
    generator = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, ())))
    rows = (heads + 2 * kv_heads) * head_dim

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(torch.bfloat16)

    x, weight, bias = normal(tokens, hidden), normal(rows, hidden) * hidden**-0.5, normal(rows)
    _, _, _, positions, inv_freq, cache, slots = _case(
        (tokens, heads, kv_heads, head_dim), torch.bfloat16, device, cache_dtype=cache_dtype
    )
    return x, weight, bias, positions, inv_freq, cache, slots


def _check_fused(
    shape: tuple[int, int, int, int, int],
    device: str,
    tolerance: dict,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """The fused q/k/v GEMV + RoPE + cache write, and its tensor-core version, against the
    reference composite, into a poisoned q view and cache."""
    qkv_rope_triton = pytest.importorskip("gptoss_serve.kernels._qkv_rope").qkv_rope_triton
    from gptoss_serve.kernels.linear import GemvTiles, MmaTiles  # noqa: PLC0415

    tokens, heads, kv_heads, head_dim, _ = shape
    x, weight, bias, positions, inv_freq, cache, slots = _qkv_case(shape, device, cache_dtype)
    scaling = GPT_OSS_ROPE.attention_scaling
    table = rope_cos_sin_table(131072, inv_freq, scaling)
    poisoned_cache, expected_cache = cache.clone(), cache.clone()
    expected = qkv_rope_and_cache_write_reference(
        x, weight, bias, positions, inv_freq, scaling, expected_cache[:, 0],
        expected_cache[:, 1], slots, num_heads=heads, num_kv_heads=kv_heads,
    )  # fmt: skip
    out_buffer = poisoned((tokens, heads, head_dim + 3), torch.bfloat16, device)
    out = out_buffer[..., :head_dim]
    # 2 NeoX pairs a program, then 1 (on the GPU 4 too: its table's tile); on the tensor cores
    # (whole heads of a power-of-two size) the table's tiles (one head) and two heads on a
    # shorter pipeline (interpreted: two heads, 64-column steps, 2 stages)
    mma_tiles = [MmaTiles(rows=2 * head_dim, block_k=64, num_stages=2)] if device == "cpu" else [
        MmaTiles(), MmaTiles(rows=128, num_stages=3)]  # fmt: skip
    if head_dim & (head_dim - 1):
        mma_tiles = []
    gemv_tiles = [GemvTiles(4, 4), GemvTiles(2, 4)]
    if device == "cuda":
        gemv_tiles.append(GemvTiles(8, 4))
    for tiles in [*gemv_tiles, *mma_tiles]:
        cache.copy_(poisoned_cache)
        out_buffer.fill_(float("nan"))
        actual = qkv_rope_triton(
            x, weight, bias, positions, table, cache[:, 0], cache[:, 1], slots,
            num_heads=heads, num_kv_heads=kv_heads, tiles=tiles, out=out,
        )  # fmt: skip
        assert actual is out and out_buffer[..., head_dim:].isnan().all()
        assert_close(actual, expected, **tolerance)
        _check_cache_rows(cache, expected_cache, slots, tolerance, exact_v=False)


def test_qkv_reference_is_projection_then_rope() -> None:
    shape = (5, 4, 2, 16, 48)
    x, weight, bias, positions, inv_freq, cache, slots = _qkv_case(shape, "cpu")
    x, weight, bias = x.float(), weight.float(), bias.float()
    cache = cache.float()
    expected_cache = cache.clone()
    q = qkv_rope_and_cache_write_reference(
        x, weight, bias, positions, inv_freq, 1.3, cache[:, 0], cache[:, 1], slots,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    qkv = x @ weight.T + bias
    expected = rope_and_cache_write_reference(
        qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16),
        positions, inv_freq, 1.3, expected_cache[:, 0], expected_cache[:, 1], slots,
    )  # fmt: skip
    assert_close(q, expected, max_rel=1e-6, rms_rel=1e-7)
    assert torch.equal(cache.isnan(), expected_cache.isnan())
    # The CPU dispatch is the reference; a weight of the wrong height is refused.
    again = qkv_rope_and_cache_write(
        x, weight, bias, positions, inv_freq, 1.3, cache[:, 0], cache[:, 1], slots,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    assert torch.equal(again, q)
    with pytest.raises(ValueError, match="rows"):
        qkv_rope_and_cache_write(
            x, weight[:-16], bias[:-16], positions, inv_freq, 1.3, cache[:, 0], cache[:, 1],
            slots, num_heads=4, num_kv_heads=2,
        )  # fmt: skip


@interpreter
@pytest.mark.parametrize("shape", [(3, 5, 3, 12, 40), (1, 4, 2, 16, 64), (8, 3, 1, 8, 24)])
def test_fused_qkv_kernel_interpreted(shape: tuple[int, int, int, int, int]) -> None:
    _check_fused(shape, "cpu", INTERPRETER_BF16)


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("tokens", [1, 3, 8, 17, 33, 64])
def test_fused_qkv_kernel_gpu(tokens: int) -> None:
    _check_fused((tokens, 64, 8, 64, 2880), "cuda", TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_qkv_kernel_gpu_fp8_cache(tokens: int) -> None:
    _check_fused((tokens, 64, 8, 64, 2880), "cuda", TOLERANCE[torch.bfloat16], cache_dtype=FP8)


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize(
    "tokens",
    [1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, 8, QKV_MMA_MAX_TOKENS, QKV_MMA_MAX_TOKENS + 1],
)
def test_fused_qkv_dispatch_gpu(tokens: int) -> None:
    """The op (fused GEMV up to GEMV_MAX_TOKENS, the fused tensor-core kernel up to
    QKV_MMA_MAX_TOKENS, linear + rope kernel beyond) against the unfused kernels: the same bf16
    q/k/v values, so the same outputs up to an output rounding."""
    x, weight, bias, positions, inv_freq, cache, slots = _qkv_case((tokens, 64, 8, 64, 2880),
                                                                   "cuda")  # fmt: skip
    scaling = GPT_OSS_ROPE.attention_scaling
    unfused_cache = cache.clone()
    q = qkv_rope_and_cache_write(
        x, weight, bias, positions, inv_freq, scaling, cache[:, 0], cache[:, 1], slots,
        num_heads=64, num_kv_heads=8, cos_sin=rope_cos_sin_table(131072, inv_freq, scaling),
        pdl=True,
    )  # fmt: skip
    qkv = linear(x, weight, bias)
    unfused = rope_and_cache_write(
        qkv[:, :4096].view(tokens, 64, 64), qkv[:, 4096:4608].view(tokens, 8, 64),
        qkv[:, 4608:].view(tokens, 8, 64), positions, inv_freq, scaling,
        unfused_cache[:, 0], unfused_cache[:, 1], slots,
    )  # fmt: skip
    # Bit for bit on the H200 (bench/RESULTS.md v8); the gate allows an output rounding.
    assert_close(q, unfused, **TOLERANCE[torch.bfloat16])
    assert torch.equal(cache.isnan(), unfused_cache.isnan())
    written = cache.isfinite()
    assert_close(cache[written], unfused_cache[written], **TOLERANCE[torch.bfloat16])


def test_cos_sin_table_rows_are_rope_cos_sin() -> None:
    inv_freq = yarn_inv_freq(64, GPT_OSS_ROPE)
    table = rope_cos_sin_table(4096, inv_freq, 1.3)
    positions = torch.tensor([0, 1, 777, 4095])
    cos, sin = rope_cos_sin(positions, inv_freq, 1.3)
    assert table.shape == (4096, 64) and table.dtype == torch.float32
    assert torch.equal(table[positions], torch.cat((cos, sin), dim=1))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU")
@pytest.mark.parametrize("t_pad", [16, 64])
def test_fused_mma_kernel_builds_a_pipelined_wgmma_for_sm90(t_pad: int) -> None:
    """The fused tensor-core kernel's table tiles (sm_90 build, 120b shapes): a head is one
    wgmma (its two 32-row halves as two products compiled to mma.sync and lost, RESULTS v24),
    the weight stream goes through cp.async after the PDL wait, nothing spills."""
    from moe_cases import compile_sm90  # noqa: PLC0415

    from gptoss_serve.kernels import _qkv_rope_mma  # noqa: PLC0415
    from gptoss_serve.kernels.rope import QKV_MMA_TILES  # noqa: PLC0415

    tiles = QKV_MMA_TILES
    constexprs = dict(A=64, KV=8, HALF=32, K=2880, BK=tiles.block_k, T_PAD=t_pad,
                      BP=tiles.rows // 2, NUM_STAGES=tiles.num_stages, PDL=True,
                      INTERPRET=False)  # fmt: skip
    pointers = {name: "*bf16" for name in ("x_ptr", "weight_ptr", "bias_ptr", "q_out_ptr",
                                           "k_cache_ptr", "v_cache_ptr")}  # fmt: skip
    pointers |= {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64"}
    ptx = compile_sm90(_qkv_rope_mma._qkv_rope_mma_kernel, constexprs, pointers,
                       dict(num_warps=tiles.num_warps))  # fmt: skip
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert "cp.async" not in before
    assert "cp.async" in after and "wgmma" in after and "mma.sync" not in ptx
    assert ".local" not in ptx
