"""Does HBM's access pattern bound the MoE at large decode batches? (H200 / H100)

At 17-128 tokens the grouped-columns MoE streams ~1 GB a launch (the ~110 touched experts) in
64-row tiles, 64 bytes of each row per 128-column step: in the checkpoint's layout those are
64-byte pieces 1,440 bytes apart. Two probes over 110 x 5,760 rows of 1,440 bytes:

1. the bytes alone (XOR of the words, no decode, no MMA): rows per program, bytes per row per
   step, stages, warps, and a contiguous layout (each program's step one run of bytes);
2. the decode GEMV of moe_layout_probe.py (8 activation columns, as a group of the grouped
   columns; K = 1,408, 22 whole steps) on blocks in step-major bands of LB rows
   (kernels/mxfp4_layout.py; LB = 1 is the checkpoint's layout).

    cd bench && python3 moe_layout_stream.py [--out results/moe_layout_stream.json]
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, PLR0917
from __future__ import annotations

import statistics
import sys

import moe_layout_probe as probe
import torch
import triton
import triton.language as tl

from kernels import copy_tbps, graph_time_ms

ROW_BYTES, NUM_ROWS = 1440, 110 * 5760
_ROW_BYTES = tl.constexpr(ROW_BYTES)  # in the kernel
# (rows per program, bytes per row per step, stages, warps, contiguous)
STREAM = [
    (64, 64, 3, 2, False), (64, 64, 3, 2, True), (64, 128, 3, 2, False), (64, 128, 3, 4, False),
    (64, 256, 2, 4, False), (64, 256, 3, 4, False), (128, 64, 3, 4, False), (32, 64, 4, 1, False),
    (64, 64, 5, 2, False), (64, 128, 3, 2, True), (64, 256, 3, 4, True),
]  # fmt: skip
# (rows per tile, warps, stages, LB)
GEMV = [(64, 2, 3, 1), (64, 2, 3, 16), (64, 2, 3, 64), (64, 2, 4, 64), (64, 4, 3, 64),
        (128, 4, 3, 1), (128, 4, 3, 128), (64, 2, 3, 32)]  # fmt: skip


@triton.jit
def _stream_kernel(blocks_ptr, out_ptr, R: tl.constexpr, STEP: tl.constexpr,
                   NSTEPS: tl.constexpr, STAGES: tl.constexpr,
                   CONTIGUOUS: tl.constexpr):  # fmt: skip
    """XOR of this program's R rows (or its contiguous run of R·NSTEPS·STEP bytes)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, STEP // 4)
    words = blocks_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([R, STEP // 4], tl.int32)
    for s in tl.range(0, NSTEPS, num_stages=STAGES):
        if CONTIGUOUS:
            run = (pid * NSTEPS + s) * R + tl.arange(0, R)
            acc = acc ^ tl.load(words + run[:, None] * (STEP // 4) + cols[None, :])
        else:
            rows = pid * R + tl.arange(0, R)
            ptrs = words + rows[:, None] * (_ROW_BYTES // 4) + s * (STEP // 4) + cols[None, :]
            mask = (s * STEP + cols * 4 < _ROW_BYTES)[None, :]
            acc = acc ^ tl.load(ptrs, mask=mask, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def stream_rows() -> list[dict]:
    blocks = torch.randint(0, 2**31 - 1, (NUM_ROWS * ROW_BYTES // 4,), dtype=torch.int32,
                           device="cuda")  # fmt: skip
    rows = []
    for r, step, stages, warps, contiguous in STREAM:
        nsteps = ROW_BYTES // step if contiguous else triton.cdiv(ROW_BYTES, step)
        grid = NUM_ROWS // r
        out = torch.empty(grid, dtype=torch.int32, device="cuda")

        def launch(r=r, step=step, stages=stages, warps=warps, contiguous=contiguous,
                   nsteps=nsteps, grid=grid, out=out) -> None:  # fmt: skip
            _stream_kernel[(grid,)](blocks, out, R=r, STEP=step, NSTEPS=nsteps, STAGES=stages,
                                    CONTIGUOUS=contiguous, num_warps=warps)  # fmt: skip

        us = statistics.median(graph_time_ms(launch, repeats=15)) * 1e3
        read = grid * r * nsteps * step if contiguous else NUM_ROWS * ROW_BYTES
        rows.append({"probe": "stream", "rows_per_program": r, "step_bytes": step,
                     "stages": stages, "warps": warps, "contiguous": contiguous,
                     "us": round(us, 1), "tbps": round(read / us / 1e6, 3)})  # fmt: skip
        sys.stdout.write(f"{rows[-1]}\n")
    return rows


def gemv_rows() -> list[dict]:
    probe.LAYERS, probe.ROWS = 2, NUM_ROWS
    k_bytes = 1408
    blocks, scales = probe.random_layers(k_bytes, k_bytes // 16)
    x = torch.randn(2 * k_bytes, device="cuda").to(torch.bfloat16)
    out = torch.empty(NUM_ROWS, device="cuda")
    rows = []
    for bn, warps, stages, lb in GEMV:

        def launch(bn=bn, warps=warps, stages=stages, lb=lb) -> None:
            for layer in range(probe.LAYERS):
                probe._probe_kernel[(NUM_ROWS // bn,)](
                    x, blocks[layer], scales[layer], out, BN=bn, SPLIT=1, STEPS=k_bytes // 64,
                    NUM_STAGES=stages, LB=lb, K_BYTES=k_bytes, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip

        us = statistics.median(graph_time_ms(launch, calls=probe.LAYERS, repeats=10)) * 1e3
        tbps = NUM_ROWS * k_bytes * 17 / 16 / (us * 1e-6) / 1e12
        rows.append({"probe": "gemv", "rows_per_tile": bn, "warps": warps, "stages": stages,
                     "step_rows": lb, "us": round(us, 1), "tbps": round(tbps, 3)})  # fmt: skip
        sys.stdout.write(f"{rows[-1]}\n")
    return rows


def main() -> int:
    args = probe.parse_args(__doc__)
    rows = [{"probe": "copy", "tbps": round(copy_tbps(), 3)}, *stream_rows(), *gemv_rows()]
    return probe.write_rows(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
