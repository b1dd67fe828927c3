"""Triton side of the kernels' bit order of MXFP4 words (kernels/mxfp4_layout.py: its
module docstring says why the bits move, and ``permute_words`` is the public op with the torch
reference): both directions as (shift, mask) groups written out, and an in-place kernel that
moves every word of a tensor in one pass. At load it replaced torch's chunks of shift-and-mask
passes, which made the engine take 63.1 s to get ready instead of 43.5 and left freed blocks
pinning 0.6 GB of allocator segments (bench/RESULTS.md v20 item 7).

tests/kernels/test_moe_layout.py holds the groups written here to mxfp4_layout's."""

# Triton's conventions: UPPER_CASE constexpr parameters.
# ruff: noqa: N803
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_serve.kernels.fast_launch import launcher


@triton.jit
def _permute(w):
    """uint32 words, checkpoint bit order -> the kernels' (mxfp4_layout.permute_words)."""
    return (
        ((w & 0x07000000) >> 15) | ((w & 0x60006000) >> 13) | ((w & 0x80008000) >> 12)
        | ((w & 0x08000800) >> 9) | ((w & 0x10701000) >> 8) | ((w & 0x00800080) >> 2)
        | ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12) | ((w & 0x00000700) << 17)
        | ((w & 0x00000070) << 24)
    )  # fmt: skip


@triton.jit
def _unpermute(w):
    """uint32 words in the kernels' bit order -> the checkpoint's (the inverse of
    ``_permute``)."""
    return (
        ((w & 0x70000000) >> 24) | ((w & 0x0E000000) >> 17) | ((w & 0x80008000) >> 12)
        | ((w & 0x01C001C0) >> 6) | ((w & 0x00200020) << 2) | ((w & 0x00107010) << 8)
        | ((w & 0x00040004) << 9) | ((w & 0x00080008) << 12) | ((w & 0x00030003) << 13)
        | ((w & 0x00000E00) << 15)
    )  # fmt: skip


@triton.jit
def _move_words_kernel(words_ptr, num_words, FORWARD: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_words
    w = tl.load(words_ptr + offsets, mask=mask).to(tl.uint32, bitcast=True)
    w = _permute(w) if FORWARD else _unpermute(w)
    tl.store(words_ptr + offsets, w.to(tl.int32, bitcast=True), mask=mask)


_BLOCK = 4096


def move_words_(words: torch.Tensor, *, forward: bool) -> None:
    """Permute (``forward``) or restore the bits of every word of contiguous int32
    ``words``, in place."""
    num_words = words.numel()
    if not num_words:
        return
    launcher(_move_words_kernel)[(triton.cdiv(num_words, _BLOCK),)](
        words, num_words, FORWARD=forward, BLOCK=_BLOCK
    )
