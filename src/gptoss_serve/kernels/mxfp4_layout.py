"""The kernels' layout of an MXFP4 matrix's blocks: rows in step-major bands.

The checkpoint stores each row's K/2 bytes contiguously ([N, G, 16], G = K/32 groups). The
GEMV / GEMM kernels read a tile of rows one 128-column step (4 groups, 64 bytes a row) at a
time, so HBM sees 64-byte pieces 1,440 bytes apart (K = 2880). In the "step rows" layout of
``rows`` = R, rows are cut into bands of R; inside a band, step s of all R rows is one
contiguous R x 64 bytes, the steps one after the other, and the last partial step (G % 4
groups; 2 at K = 2880) closes the band as R x 16·(G % 4) bytes. Same bytes, same size, the
tensor keeps its [..., N, G, 16] shape; R = 1 is the checkpoint's layout itself.

Measured (bench/RESULTS.md v13, H100 and H200): a GEMV of 8 columns over 0.9 GB of rows, the
shape of a 64-token decode step's MoE, 1.94 -> 2.69-2.83 TB/s at R = 16-64 on the H100; a bare
stream of the same bytes on the H200 2.18 -> 3.91 TB/s. At batch 1 (33 MB a launch) it moved
nothing (v8): there the launch's latency chain, not HBM's access pattern, is the limit.

Byte of (row n, group g): band (n // R)·R·G·16, then for g < 4·(G // 4): (g // 4)·R·64 +
(n % R)·64 + (g % 4)·16; for the last partial step: (G // 4)·R·64 + (n % R)·16·(G % 4) +
(g % 4)·16 (kernels: _moe_gemv._slot_blocks, _moe_dequant._packed_offsets).
"""

from __future__ import annotations

import torch

# The engine's bands on CUDA: 16 rows make each step a contiguous KiB, which the GEMV probe
# measured as fast as 64 (2.69 vs 2.71 TB/s on the H100), and they divide every gpt-oss matrix.
STEP_ROWS = 16


def _check(blocks: torch.Tensor, rows: int) -> tuple[int, int, int]:
    if blocks.dim() < 3 or blocks.shape[-1] != 16:
        raise ValueError(f"expected [..., N, G, 16] blocks, got {tuple(blocks.shape)}")
    n, g = blocks.shape[-3], blocks.shape[-2]
    if rows < 1 or n % rows:
        raise ValueError(f"step rows {rows} must divide the {n} rows")
    return n, g, g // 4


def to_step_rows(blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """Checkpoint-layout blocks [..., N, G, 16] -> the same bytes in bands of ``rows`` (one new
    tensor of the same size, no other temporary)."""
    n, g, full = _check(blocks, rows)
    if rows == 1:
        return blocks.contiguous()
    lead = blocks.shape[:-3]
    bands = blocks.reshape(*lead, n // rows, rows, g * 16)
    out = torch.empty_like(blocks)
    out_bands = out.view(*lead, n // rows, rows * g * 16)
    main = out_bands[..., : rows * full * 64].view(*lead, n // rows, full, rows, 64)
    main.copy_(bands[..., : full * 64].unflatten(-1, (full, 64)).transpose(-3, -2))
    tail = out_bands[..., rows * full * 64 :].view(*lead, n // rows, rows, -1)
    tail.copy_(bands[..., full * 64 :])
    return out


def from_step_rows(blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``to_step_rows``: bands of ``rows`` back to the checkpoint's rows."""
    n, g, full = _check(blocks, rows)
    if rows == 1:
        return blocks
    lead = blocks.shape[:-3]
    bands = blocks.reshape(*lead, n // rows, rows * g * 16)
    out = torch.empty_like(blocks)
    out_bands = out.view(*lead, n // rows, rows, g * 16)
    main = bands[..., : rows * full * 64].view(*lead, n // rows, full, rows, 64)
    out_bands[..., : full * 64].unflatten(-1, (full, 64)).copy_(main.transpose(-3, -2))
    tail = bands[..., rows * full * 64 :].view(*lead, n // rows, rows, -1)
    out_bands[..., full * 64 :].copy_(tail)
    return out
