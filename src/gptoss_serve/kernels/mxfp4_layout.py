"""The kernels' layout of an MXFP4 matrix's blocks and scales: rows in step-major bands,
padded to whole steps.

The checkpoint stores each row's K/2 bytes contiguously ([N, G, 16], G = K/32 groups). The
GEMV / GEMM kernels read a tile of rows one 128-column step (4 groups, 64 bytes a row) at a
time, so HBM sees 64-byte pieces 1,440 bytes apart (K = 2880). In the "step rows" layout of
``rows`` = R > 1, each row is padded to GP = 4·ceil(G / 4) groups (92 at K = 2880) with zero
bytes, rows are cut into bands of R, and inside a band step s of all R rows is one contiguous
R x 64 bytes, the steps one after the other: [..., N, GP, 16]. The scales are padded the same
way, [..., N, GP] (zeros: code 0 times any scale is 0), so every step of every row is whole
and the kernels read them without masks or a partial last step. R = 1 is the checkpoint's
layout itself (no padding).

Measured (bench/RESULTS.md v13, H100 and H200): a GEMV of 8 columns over 0.9 GB of rows, the
shape of a 64-token decode step's MoE, 1.94 -> 2.69-2.83 TB/s at R = 16-64 on the H100; a bare
stream of the same bytes on the H200 2.18 -> 3.91 TB/s. At batch 1 (33 MB a launch) it moved
nothing (v8): there the launch's latency chain, not HBM's access pattern, is the limit. The
padding to whole steps (v15) costs 2.2% more bytes at K = 2880 and drops the masks and the
band's tail step from the grouped columns' loop.

Byte of (row n, group g < GP) for R > 1: (n // R)·R·GP·16 + (g // 4)·R·64 + (n % R)·64 +
(g % 4)·16 (kernels: _moe_gemv._slot_blocks, _moe_dequant._packed_offsets).

For R > 1 the bits of every 32-bit word (8 elements: nibble j, bits 4j..4j+3, is element j)
are also permuted (``permute_words``), so that the GEMVs' decode takes 8 instructions a word
instead of 13 (_moe_gemv.py: 12 with the scale multiplies, against 17). The decode turns the
pair (element a, element a + 4) into a bf16x2 word whose fields sit at bits 6-8 and 15 (low
half: mantissa, exponent, sign) and 22-24 and 31 (high half). In the permuted word pair 0
already sits there (one AND), pairs 1 and 2 sit there rotated left by 10 and 13 bits (a
funnel shift and an AND each), and pair 3 takes the 8 bits left, from which one multiply by
2^2 + 2^7 + 2^12 (no two partial products overlap: no carries) copies each into place (AND,
multiply, AND). Three rotations cannot tile the word with the fourth pair's fields too (a
brute-force search), so one pair keeps a multiply. MoE prefill on the H100 +6-10% (RESULTS
v20).
"""

from __future__ import annotations

import torch

# The engine's bands on CUDA: 16 rows make each step a contiguous KiB, which the GEMV probe
# measured as fast as 64 (2.69 vs 2.71 TB/s on the H100), and they divide every gpt-oss matrix.
STEP_ROWS = 16


def _word_bits() -> tuple[tuple[int, int], ...]:
    """(checkpoint bit, permuted bit) of the 32 bits of a word (module docstring)."""
    decoded = (6, 7, 8, 15)  # where the decode puts a low element's bits 0-3 (+16: high)
    moves = []
    for pair, rotation in ((0, 0), (1, 10), (2, 13)):
        for half, element in ((0, pair), (16, pair + 4)):
            moves += [(4 * element + b, (decoded[b] + half - rotation) % 32) for b in range(4)]
    # Pair 3 (elements 3 and 7): after the multiply, bit s lands at s + 2, s + 7 or s + 12.
    moves += [(12 + b, q) for b, q in enumerate((4, 0, 1, 3))]  # -> 6, 7, 8, 15
    moves += [(28 + b, q) for b, q in enumerate((20, 16, 17, 19))]  # -> 22, 23, 24, 31
    return tuple(moves)


WORD_BITS = _word_bits()


def _shift_groups(moves) -> tuple[tuple[int, int], ...]:
    """(shift, mask of the source bits) for the moves that share a shift."""
    groups: dict[int, int] = {}
    for source, target in moves:
        groups[target - source] = groups.get(target - source, 0) | (1 << source)
    return tuple(sorted(groups.items()))


_FORWARD = _shift_groups(WORD_BITS)
_INVERSE = _shift_groups((target, source) for source, target in WORD_BITS)
_CHUNK_WORDS = 1 << 24  # words converted at once (64 MiB of int32, int64 temporaries)


def _move_bits(
    blocks: torch.Tensor, *, forward: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 [..., 16] (contiguous) -> ``out`` (new, or ``blocks`` itself: in place) with every
    little-endian 32-bit word's bits permuted (``forward``) or restored. On CUDA one in-place
    Triton pass (kernels/_word_bits.py); elsewhere, and as its reference, torch a chunk at a
    time."""
    if not blocks.is_cuda:
        return _move_bits_torch(blocks, forward=forward, out=out)
    from gptoss_serve.kernels import _word_bits  # noqa: PLC0415 (Triton: GPU only)

    if out is None:
        out = blocks.clone()
    elif out is not blocks:
        out.copy_(blocks)
    _word_bits.move_words_(out.view(torch.int32), forward=forward)
    return out


def _move_bits_torch(
    blocks: torch.Tensor, *, forward: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``_move_bits`` in torch, a chunk of words at a time (any device)."""
    groups = _FORWARD if forward else _INVERSE
    out = torch.empty_like(blocks) if out is None else out
    words, out_words = blocks.view(torch.int32).view(-1), out.view(torch.int32).view(-1)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF  # unsigned
        moved = torch.zeros_like(chunk)
        for shift, mask in groups:
            part = chunk & mask
            moved |= part << shift if shift >= 0 else part >> -shift
        signed = moved - ((moved >> 31) << 32)  # the uint32 value as int32's two's complement
        out_words[start : start + _CHUNK_WORDS] = signed.to(torch.int32)
    return out


def permute_words(blocks: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Blocks [..., 16] uint8 with each 32-bit word's bits in the GEMVs' decode order (a new
    tensor, or ``blocks`` itself, contiguous, with ``in_place``)."""
    if in_place:
        return _move_bits(blocks, forward=True, out=blocks)
    return _move_bits(blocks.contiguous(), forward=True)


def unpermute_words(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``permute_words``."""
    return _move_bits(blocks.contiguous(), forward=False)


def stored_groups(groups: int, rows: int) -> int:
    """Groups a row holds in the layout of ``rows``: G in the checkpoint's (1), else whole
    steps."""
    return groups if rows == 1 else 4 * -(-groups // 4)


def _check(blocks: torch.Tensor, rows: int) -> tuple[int, int]:
    if blocks.dim() < 3 or blocks.shape[-1] != 16:
        raise ValueError(f"expected [..., N, G, 16] blocks, got {tuple(blocks.shape)}")
    n = blocks.shape[-3]
    if rows < 1 or n % rows:
        raise ValueError(f"step rows {rows} must divide the {n} rows")
    return n, blocks.shape[-2]


def to_step_rows(blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """Checkpoint-layout blocks [..., N, G, 16] -> bands of ``rows``, padded to whole steps
    [..., N, GP, 16], each word's bits permuted (``permute_words``)."""
    n, g = _check(blocks, rows)
    if rows == 1:
        return blocks.contiguous()
    lead = blocks.shape[:-3]
    full, steps = g // 4, stored_groups(g, rows) // 4
    bands = blocks.reshape(*lead, n // rows, rows, g * 16)
    out = torch.zeros(*lead, n // rows, steps, rows, 64, dtype=blocks.dtype, device=blocks.device)
    out[..., :full, :, :].copy_(bands[..., : full * 64].unflatten(-1, (full, 64)).transpose(-3, -2))
    if full < steps:  # the partial last step, its padding left zero
        out[..., full, :, : 16 * (g % 4)].copy_(bands[..., full * 64 :])
    return permute_words(out.view(*lead, n, 4 * steps, 16), in_place=True)


def from_step_rows(blocks: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """The inverse of ``to_step_rows``: bands of ``rows`` back to the checkpoint's rows of
    ``groups`` groups."""
    n, stored = _check(blocks, rows)
    if stored != stored_groups(groups, rows):
        raise ValueError(f"{stored} stored groups a row do not hold {groups} in rows of {rows}")
    if rows == 1:
        return blocks
    lead = blocks.shape[:-3]
    full, steps = groups // 4, stored // 4
    bands = unpermute_words(blocks).view(*lead, n // rows, steps, rows, 64)
    out = torch.empty(*lead, n, groups, 16, dtype=blocks.dtype, device=blocks.device)
    out_bands = out.view(*lead, n // rows, rows, groups * 16)
    out_bands[..., : full * 64].unflatten(-1, (full, 64)).copy_(
        bands[..., :full, :, :].transpose(-3, -2)
    )
    if full < steps:
        out_bands[..., full * 64 :].copy_(bands[..., full, :, : 16 * (groups % 4)])
    return out


def scales_to_step_rows(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """Checkpoint scales [..., N, G] -> padded to the stored groups of ``rows`` with zeros."""
    groups = scales.shape[-1]
    pad = stored_groups(groups, rows) - groups
    return torch.nn.functional.pad(scales, (0, pad)) if pad else scales.contiguous()


def scales_from_step_rows(scales: torch.Tensor, groups: int) -> torch.Tensor:
    """The checkpoint's scales [..., N, G] of padded ones (a view)."""
    return scales[..., :groups]
