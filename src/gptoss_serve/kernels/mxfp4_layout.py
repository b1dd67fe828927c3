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
"""

from __future__ import annotations

import torch

# The engine's bands on CUDA: 16 rows make each step a contiguous KiB, which the GEMV probe
# measured as fast as 64 (2.69 vs 2.71 TB/s on the H100), and they divide every gpt-oss matrix.
STEP_ROWS = 16


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
    [..., N, GP, 16] (one new tensor, no other temporary)."""
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
    return out.view(*lead, n, 4 * steps, 16)


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
    bands = blocks.reshape(*lead, n // rows, steps, rows, 64)
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
