"""The blocks' step-rows layout (kernels/mxfp4_layout.py): the torch re-layout and its
inverse, padded to whole steps, the references on re-laid weights, and every Triton MoE path
giving the same bits on re-laid weights as on the checkpoint's rows (only the addresses and
the zero padding differ)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_cases import INTERPRETING, fresh_seed, random_weights, random_x

from gptoss_serve.kernels import mxfp4_layout
from gptoss_serve.kernels.moe import MoeWeights, mxfp4_moe_reference
from gptoss_serve.kernels.mxfp4_layout import (
    WORD_BITS,
    from_step_rows,
    permute_words,
    scales_to_step_rows,
    stored_groups,
    to_step_rows,
    unpermute_words,
)

needs_triton = pytest.mark.skipif(
    not INTERPRETING, reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1"
)


def byte_offset(n: int, g: int, groups: int, rows: int) -> int:
    """The layout's documented address of (row n, group g) in one matrix, in bytes."""
    if rows == 1:
        return (n * groups + g) * 16
    band = (n // rows) * rows * stored_groups(groups, rows) * 16
    return band + (g // 4) * rows * 64 + (n % rows) * 64 + (g % 4) * 16


@pytest.mark.parametrize(
    ("shape", "rows"),
    [((2, 64, 90, 16), 16), ((3, 32, 5, 16), 16), ((1, 48, 3, 16), 16), ((2, 64, 7, 16), 32),
     ((2, 16, 8, 16), 1)],
)  # fmt: skip
def test_step_rows_layout(shape: tuple[int, ...], rows: int) -> None:
    """Round trip, every byte where the layout's formula puts it (past rows = 1, in words with
    their bits permuted) and zeros in the padding to whole steps (K = 2880: 22 steps and a
    half; 5 and 3 groups: a one- and a three-group partial step; 8: none)."""
    generator = torch.Generator().manual_seed(fresh_seed())
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    laid = to_step_rows(blocks, rows)
    moved = permute_words(blocks) if rows > 1 else blocks
    lead, n_rows, groups, _ = shape
    stored = stored_groups(groups, rows)
    assert laid.shape == (lead, n_rows, stored, 16)
    assert torch.equal(from_step_rows(laid, rows, groups), blocks)
    flat = laid.reshape(lead, -1)
    written = torch.zeros(flat.shape, dtype=torch.bool)
    for n in range(n_rows):
        for g in range(groups):
            offset = byte_offset(n, g, groups, rows)
            assert torch.equal(flat[:, offset : offset + 16], moved[:, n, g])
            written[:, offset : offset + 16] = True
    assert not flat[~written].any()  # the padding
    scales = torch.randint(0, 256, shape[:-1], dtype=torch.uint8, generator=generator)
    padded = scales_to_step_rows(scales, rows)
    assert padded.shape == (lead, n_rows, stored)
    assert torch.equal(padded[..., :groups], scales) and not padded[..., groups:].any()


def _rotl(word: int, k: int) -> int:
    return ((word << k) | (word >> (32 - k))) & 0xFFFFFFFF if k else word


def _fields(value: int) -> tuple[int, int]:
    """The two nibbles a decoded bf16x2 word holds: bits 6, 7, 8, 15 and 22, 23, 24, 31."""
    return tuple(
        sum(((value >> (bit + half)) & 1) << i for i, bit in enumerate((6, 7, 8, 15)))
        for half in (0, 16)
    )  # fmt: skip


def test_permuted_words_decode_with_the_kernels_operations() -> None:
    """The permutation is a bijection of the 32 bits, its inverse undoes it, and on random
    words the GEMVs' permuted decode (_moe_gemv._DECODE_PERMUTED_PTX: AND; rotate 10, AND;
    rotate 13, AND; AND, multiply by 0x1084, AND) gives the pairs (element a, element a + 4)
    of the checkpoint's word."""
    assert sorted(s for s, _ in WORD_BITS) == sorted(t for _, t in WORD_BITS) == list(range(32))
    generator = torch.Generator().manual_seed(fresh_seed())
    blocks = torch.randint(0, 256, (64, 16), dtype=torch.uint8, generator=generator)
    permuted = permute_words(blocks)
    assert torch.equal(unpermute_words(permuted), blocks)
    mask = 0x81C081C0
    words = blocks.view(torch.int32).flatten().tolist()
    moved_words = permuted.view(torch.int32).flatten().tolist()
    for signed, signed_moved in zip(words, moved_words, strict=True):
        word, moved = signed & 0xFFFFFFFF, signed_moved & 0xFFFFFFFF
        pairs = [(word >> 4 * a & 15, word >> 4 * (a + 4) & 15) for a in range(4)]
        decoded = [moved & mask, _rotl(moved, 10) & mask, _rotl(moved, 13) & mask,
                   ((moved & 0x001B001B) * 0x1084) & mask]  # fmt: skip
        assert [_fields(value) for value in decoded] == pairs


@pytest.mark.parametrize(
    ("function", "groups"), [("_permute", "_FORWARD"), ("_unpermute", "_INVERSE")]
)
def test_the_kernels_word_bits_match_the_layout(function: str, groups: str) -> None:
    """kernels/_word_bits.py's two directions (the in-place load kernel's, the portable decode's
    and the grouped GEMMs'), written out in Triton, hold exactly mxfp4_layout's (shift, mask)
    groups."""
    import inspect  # noqa: PLC0415
    import re  # noqa: PLC0415

    pytest.importorskip("triton")
    from gptoss_serve.kernels import _word_bits  # noqa: PLC0415

    source = inspect.getsource(_word_bits).split(f"def {function}(")[1].split("@triton.jit")[0]
    terms = re.findall(r"\(w & (0x[0-9A-Fa-f]+)\) (>>|<<) (\d+)", source)
    written = sorted((int(k) if op == "<<" else -int(k), int(m, 16)) for m, op, k in terms)
    assert written == sorted(getattr(mxfp4_layout, groups))


@needs_triton
def test_word_bits_kernel_in_the_interpreter() -> None:
    """The in-place pass (called directly: on CPU tensors permute_words takes torch's path)
    both ways against the torch reference, and on no words at all."""
    from gptoss_serve.kernels import _word_bits  # noqa: PLC0415

    generator = torch.Generator().manual_seed(fresh_seed())
    blocks = torch.randint(0, 256, (3, 1001, 16), dtype=torch.uint8, generator=generator)
    moved = blocks.clone()
    _word_bits.move_words_(moved.view(torch.int32), forward=True)
    assert torch.equal(moved, mxfp4_layout._move_bits_torch(blocks, forward=True))
    _word_bits.move_words_(moved.view(torch.int32), forward=False)
    assert torch.equal(moved, blocks)
    _word_bits.move_words_(torch.empty(0, dtype=torch.int32), forward=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_word_bits_kernel_matches_the_torch_reference() -> None:
    """The in-place Triton pass of permute_words / unpermute_words on CUDA equals the torch
    chunks, on random bytes of an odd word count."""
    generator = torch.Generator(device="cuda").manual_seed(fresh_seed())
    blocks = torch.randint(0, 256, (3, 1001, 16), dtype=torch.uint8, device="cuda",
                           generator=generator)  # fmt: skip
    expected = mxfp4_layout._move_bits_torch(blocks, forward=True)
    assert torch.equal(permute_words(blocks), expected)
    assert torch.equal(unpermute_words(expected), blocks)
    in_place = blocks.clone()
    assert permute_words(in_place, in_place=True) is in_place
    assert torch.equal(in_place, expected)


def test_step_rows_refuses_other_groups() -> None:
    laid = to_step_rows(torch.zeros(1, 16, 5, 16, dtype=torch.uint8), 16)
    with pytest.raises(ValueError, match="do not hold 9"):
        from_step_rows(laid, 16, 9)


def test_step_rows_must_divide_the_rows() -> None:
    with pytest.raises(ValueError, match="must divide"):
        to_step_rows(torch.zeros(1, 24, 4, 16, dtype=torch.uint8), 16)
    weights = random_weights(4, 64, 32)
    with pytest.raises(ValueError, match="step_rows 48 must divide"):
        dataclasses.replace(weights, step_rows=48).check()


def test_reference_reads_step_rows() -> None:
    """The plain-torch path undoes the layout: same output from re-laid weights."""
    weights = random_weights(8, 160, 96, seed=3)
    laid = weights.with_step_rows(16)
    assert laid.step_rows == 16
    assert not torch.equal(laid.gate_up_blocks, weights.gate_up_blocks)
    assert laid.gate_up_scales.shape[-1] == 8  # 5 groups padded to two whole steps
    gate_up, gate_up_scales, down, down_scales = laid.checkpoint_matrices(5)
    assert torch.equal(gate_up, weights.gate_up_blocks[5])
    assert torch.equal(gate_up_scales, weights.gate_up_scales[5])
    assert torch.equal(down, weights.down_blocks[5])
    assert torch.equal(down_scales, weights.down_scales[5])
    laid.check()
    assert torch.equal(laid.with_step_rows(1).gate_up_blocks, weights.gate_up_blocks)
    assert torch.equal(laid.with_step_rows(1).down_scales, weights.down_scales)
    x = random_x(7, 160)
    assert torch.equal(mxfp4_moe_reference(x, laid), mxfp4_moe_reference(x, weights))


def test_for_kernels_keeps_cpu_weights() -> None:
    """Off CUDA the weights stay in the checkpoint's rows (the reference reads them as they are)."""
    weights = random_weights(4, 64, 32)
    assert weights.for_kernels() is weights


def same_bits(x: torch.Tensor, weights: MoeWeights, rows: int, **kwargs) -> None:
    """The Triton MoE on ``weights`` and on them in bands of ``rows``: the same bits."""
    from gptoss_serve.kernels._moe_triton import mxfp4_moe_triton  # noqa: PLC0415

    expected = mxfp4_moe_triton(x, weights, poison=True, **kwargs)
    actual = mxfp4_moe_triton(x, weights.with_step_rows(rows), poison=True, **kwargs)
    assert torch.equal(actual, expected)


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 3, 20, 40, 200])
def test_interpreter_step_rows_same_bits(num_tokens: int) -> None:
    """Per-pair GEMVs (1, 3 tokens), grouped columns (20, 40), wgmma columns (200): H = 160
    (5 groups: a one-group tail), I = 96 (3 groups: no whole step at all)."""
    weights = random_weights(8, 160, 96, seed=num_tokens)
    same_bits(random_x(num_tokens, 160, seed=num_tokens + 1), weights, 16)


@needs_triton
def test_interpreter_step_rows_grouped_gemm_same_bits() -> None:
    """The grouped GEMMs (past DECODE_MAX_TOKENS; forced by ``tiles``) and their decode."""
    from gptoss_serve.kernels._moe_triton import dequantize_mxfp4_triton, tiles_for  # noqa: PLC0415

    weights = random_weights(8, 160, 96, seed=9)
    same_bits(random_x(24, 160, seed=10), weights, 16, tiles=tiles_for(24, 8))
    laid = weights.with_step_rows(16)
    expected = dequantize_mxfp4_triton(weights.gate_up_blocks[2], weights.gate_up_scales[2])
    actual = dequantize_mxfp4_triton(laid.gate_up_blocks[2], laid.gate_up_scales[2],
                                     step_rows=16)  # fmt: skip
    assert torch.equal(actual[:, :160], expected) and not actual[:, 160:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 8, 16, 40, 64, 128, 300, 2048])
def test_gpu_step_rows_same_bits(gpu_weights: MoeWeights, num_tokens: int) -> None:
    """Every row of the decode table at 120b / 20b shapes (K = 2880: 22 steps and a half),
    with PDL as the engine launches them."""
    torch.manual_seed(fresh_seed())
    x = torch.randn(num_tokens, 2880, device="cuda").bfloat16()
    same_bits(x, gpu_weights, 16, pdl=True)


@pytest.mark.gpu
def test_gpu_step_rows_grouped_gemm_same_bits(gpu_weights: MoeWeights) -> None:
    from gptoss_serve.kernels._moe_triton import tiles_for  # noqa: PLC0415

    x = torch.randn(300, 2880, device="cuda").bfloat16()
    same_bits(x, gpu_weights, 16, tiles=tiles_for(300, gpu_weights.num_experts))
