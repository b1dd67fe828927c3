"""Dense projection y = x @ W^T + b for the decode step's few tokens (q/k/v, o, unembedding).

With at most ``GEMV_MAX_TOKENS`` bf16 rows on CUDA it runs the Triton GEMV of ``_linear.py``
(whole weight rows per program, all bytes in flight at once); up to ``MMA_MAX_TOKENS`` rows the
Triton kernel of ``_linear_mma.py`` (the weight rows as the MMA's left operand, streamed over
K); otherwise, where the product is a real GEMM (prefill, large decode batches) or off the
GPU, it is ``torch.nn.functional.linear`` (cuBLAS on CUDA), which is also the reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gptoss_serve.kernels.launch import pdl_applies

logger = logging.getLogger(__name__)

# Token counts up to which the GEMV runs: it keeps the weight tile in registers and loops over
# the tokens on the CUDA cores, so its arithmetic grows with T while cuBLAS's tensor cores
# would not. Measured on the whole 120b decode step (H200, PDL, CUDA graph; bench/RESULTS.md
# v12, `step_tiles.py --target dense`), GEMV against cuBLAS: batch 1 2.40 against 2.77 ms,
# batch 2 3.53 against 3.56, batch 4 5.90 against 5.25, batch 8 9.68 against 7.61 (it was 8
# until then: the unembedding alone took 1,056 us at 8 tokens through the GEMV, 281 through
# cuBLAS).
GEMV_MAX_TOKENS = 2


@dataclass(frozen=True)
class GemvTiles:
    rows: int = 4  # weight rows per program (a power of two)
    num_warps: int = 8


# The GEMV's tiles by weight shape, chosen in the whole 120b decode step as the engine launches
# it (PDL, CUDA graph; bench/step_tiles.py --target dense, H200, bench/RESULTS.md v26). They
# were first chosen on plain launches of each projection alone (bench/step_profile.py: q/k/v 4
# rows x 8 warps 3.16 TB/s, o 1 x 4 3.12, the unembedding 4 x 8 4.46). Under PDL each program
# loads its rows before it waits for the kernel ahead, and the step favours other shapes: q/k/v
# 8 x 4 and o 1 x 8 took it from 2.255 to 2.184 ms at batch 1 and 1k context (-3.1%; either
# alone -1.4 / -1.7%), 2.320 -> 2.281 at 8k, batch 2 3.206 -> 3.108 at 1k. The unembedding's
# 4 x 8 held (4 x 4, 8 x 8, 2 x 4: even or slower). At 2 tokens o takes 1 x 4 (bench/RESULTS.md
# v27: batch 2, 1k, 3.100-3.119 against the table's 3.123-3.153 ms in four runs).
GEMV_TILES = GemvTiles(8, 4)  # K <= 3072 (q/k/v [5120, 2880])
GEMV_TILES_WIDE = GemvTiles(1, 8)  # K > 3072 (o [2880, 4096]), 1 token
GEMV_TILES_WIDE_PAIR = GemvTiles(1, 4)  # the same at 2 tokens
GEMV_TILES_TALL = GemvTiles(4, 8)  # 65536 rows or more (the unembedding [201088, 2880])
TALL_ROWS = 65536


def gemv_tiles_for(num_rows: int, k: int, num_tokens: int = 1) -> GemvTiles:
    """The GEMV's launch shape for an [num_rows, k] weight and ``num_tokens`` tokens (the
    table above)."""
    if k > 3072:
        return GEMV_TILES_WIDE_PAIR if num_tokens == 2 else GEMV_TILES_WIDE
    return GEMV_TILES_TALL if num_rows >= TALL_ROWS else GEMV_TILES


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    tiles: GemvTiles | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, K], weight [N, K], bias [N] -> [T, N] in ``out_dtype`` (default x's dtype);
    ``pdl``: the GEMV as a programmatic dependent launch where that applies (launch.py)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [T, K] and weight [N, K], got {x.shape}, {weight.shape}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight rows {weight.shape[0]}")
    out_dtype = out_dtype or x.dtype
    if x.is_cuda and gemv_applies(x, weight, out_dtype):
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._linear import linear_triton  # noqa: PLC0415

        tiles = tiles or gemv_tiles_for(*weight.shape, x.shape[0])
        return linear_triton(x, weight, bias, out_dtype, tiles, pdl=pdl_applies(pdl, x))
    if x.is_cuda and mma_applies(x, weight, out_dtype):
        from gptoss_serve.kernels._linear_mma import linear_mma_triton  # noqa: PLC0415

        return linear_mma_triton(x, weight, bias, out_dtype, MMA_TILES, pdl=pdl_applies(pdl, x))
    return linear_reference(x, weight, bias, out_dtype=out_dtype)


# Token counts from GEMV_MAX_TOKENS + 1 up to which the tensor-core kernel of _linear_mma.py
# runs instead of cuBLAS: the whole 120b decode step on the H100 (bench/RESULTS.md v18), cuBLAS
# against it, batch 3 4.70 / 4.71 against 4.46-4.49 ms, batch 4 5.43 / 5.43 against 5.21,
# batch 8 8.08 / 8.08 against 7.84, batch 16 12.30 / 12.30 against 12.22; at 32 and 64 tokens
# (4-stage tiles) cuBLAS was as fast or faster.
MMA_MAX_TOKENS = 16


@dataclass(frozen=True)
class MmaTiles:
    rows: int = 64  # weight rows per program: the MMA's M (wgmma from 64 rows on 4 warps)
    block_k: int = 128  # columns of K per pipelined step
    num_stages: int = 5
    num_warps: int = 4


MMA_TILES = MmaTiles()


def mma_applies(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, max_tokens: int | None = None
) -> bool:
    """Whether ``linear`` runs the tensor-core kernel for these operands (on CUDA); with
    ``max_tokens``, whether it would up to that many tokens instead of MMA_MAX_TOKENS."""
    max_tokens = MMA_MAX_TOKENS if max_tokens is None else max_tokens
    return _triton_takes(x, weight, out_dtype) and GEMV_MAX_TOKENS < x.shape[0] <= max_tokens


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``linear`` runs the Triton GEMV for these operands (on CUDA)."""
    return _triton_takes(x, weight, out_dtype) and x.shape[0] <= GEMV_MAX_TOKENS


def _triton_takes(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The operands both Triton kernels take, whatever the token count: bf16 rows [T, K] and
    weight, a bf16 or float32 output."""
    return (
        x.dim() == 2
        and x.dtype == weight.dtype == torch.bfloat16
        and out_dtype in (torch.bfloat16, torch.float32)
    )


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain torch (cuBLAS on CUDA): the numerics the GEMV is checked against."""
    return torch.nn.functional.linear(x, weight, bias).to(out_dtype or x.dtype)
