"""Does the batch-1 MoE GEMV lose bandwidth to the checkpoint's row-major layout? (H200)

The decode GEMV (_moe_gemv._mxfp4_gemv) reads, per 128-column step, 64 bytes of each of its
tile's rows: rows are 1,440 bytes apart, so HBM sees 64-byte pieces scattered over the tile.
This probe runs the same GEMV (same decode, same cp.async pipeline) over the same number of
random bytes with the rows stored in blocks of LB rows, step-major inside a block (row r of
block b, step s at b·LB·K + s·LB·64 + r·64): LB = 1 is the checkpoint's layout, LB = 16 makes
each step of 16 rows one contiguous 1 KiB. 36 layers of gate_up-sized weights (4 experts x
5,760 rows of 1,408 bytes: 22 whole steps), one launch per layer in a CUDA graph.

    cd bench && python3 moe_layout_probe.py
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from gptoss_serve.kernels._moe_gemv import _mxfp4_gemv, _tile_slots
from kernels import copy_tbps, graph_time_ms

LAYERS = 36
ROWS = 4 * 5760  # the 4 routed experts' gate_up rows at batch 1
K_BYTES = 1408  # 22 whole 128-column steps per row
# (rows per tile, K split, warps, stages, layout block rows)
CONFIGS = [
    (32, 2, 2, 4, 1), (32, 2, 2, 4, 16), (32, 2, 2, 4, 32),
    (32, 1, 2, 4, 1), (32, 1, 2, 4, 16), (32, 1, 2, 4, 32),
    (64, 2, 2, 4, 1), (64, 2, 2, 4, 16), (64, 2, 4, 4, 16), (64, 1, 4, 4, 16),
    (32, 2, 2, 6, 16), (16, 1, 1, 4, 16), (16, 1, 1, 4, 1), (32, 2, 4, 4, 16),
]  # fmt: skip


@triton.jit
def _real_k_kernel(x_ptr, blocks_ptr, scales_ptr, out_ptr, BN: tl.constexpr,
                   SPLIT: tl.constexpr, SPLIT_GROUPS: tl.constexpr, STEPS: tl.constexpr,
                   FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """The same GEMV over checkpoint rows of K = 2880 (90 groups, 22.5 steps) cut as the
    decode kernels cut them (_moe_small.split_plan): masked partial steps included."""
    R: tl.constexpr = BN // SPLIT
    n0 = tl.program_id(0) * R
    rows, t = _tile_slots(BN)
    part = rows // R
    row = (n0 + rows % R).to(tl.int64)
    first_group = part * SPLIT_GROUPS + t
    row_groups = tl.minimum(90 - part * SPLIT_GROUPS, SPLIT_GROUPS)
    cols = tl.arange(0, 8)
    col_part = cols % SPLIT
    acc, _ = _mxfp4_gemv(
        blocks_ptr + row * 1440 + 16 * first_group, scales_ptr + row * 90 + first_group,
        row_groups, t, x_ptr + col_part * (32 * SPLIT_GROUPS),
        tl.minimum(90 - col_part * SPLIT_GROUPS, SPLIT_GROUPS), BN, STEPS, FULL_STEPS, 1,
        NUM_STAGES, True, False,
    )  # fmt: skip
    keep = (tl.arange(0, BN) // R)[:, None] == cols[None, :]  # row s·R + r: column s alone
    y = tl.sum(tl.reshape(tl.sum(tl.where(keep, acc, 0.0), axis=1), [SPLIT, R]), axis=0)
    tl.store(out_ptr + n0 + tl.arange(0, R), y)


@triton.jit
def _probe_kernel(x_ptr, blocks_ptr, scales_ptr, out_ptr, BN: tl.constexpr,
                  SPLIT: tl.constexpr, STEPS: tl.constexpr, NUM_STAGES: tl.constexpr,
                  LB: tl.constexpr, K_BYTES: tl.constexpr):  # fmt: skip
    """out[rows of this tile] = the T = 1 GEMV of its rows, K split in SPLIT parts of STEPS
    (past LB = 1 it decodes the kernels' permuted bit order, as the engine's: random bytes,
    timed only)."""
    R: tl.constexpr = BN // SPLIT
    G: tl.constexpr = K_BYTES // 16
    n0 = tl.program_id(0) * R
    rows, t = _tile_slots(BN)
    part = rows // R
    row = (n0 + rows % R).to(tl.int64)
    first_step = part * STEPS
    offset = (row // LB) * (LB * K_BYTES) + (row % LB) * 64 + first_step * (LB * 64) + 16 * t
    scale_rows = scales_ptr + row * G + 4 * first_step + t
    row_groups = tl.full([4 * BN], 4 * STEPS, tl.int32)
    cols = tl.arange(0, 8)
    col_ptrs = x_ptr + (cols % SPLIT) * (STEPS * 128)
    acc, _ = _mxfp4_gemv(
        blocks_ptr + offset, scale_rows, row_groups, t, col_ptrs,
        tl.full([8], 4 * STEPS, tl.int32), BN, STEPS, STEPS, 1, NUM_STAGES, True, False,
        LB=LB,
    )  # fmt: skip
    keep = (tl.arange(0, BN) // R)[:, None] == cols[None, :]  # row s·R + r: column s alone
    y = tl.sum(tl.reshape(tl.sum(tl.where(keep, acc, 0.0), axis=1), [SPLIT, R]), axis=0)
    tl.store(out_ptr + n0 + tl.arange(0, R), y)


# K = 2880 cut as the kernels cut it: (weight rows, rows per tile, split, warps, stages);
# 23,040 rows are the 4 experts' gate_up rows at batch 1, 11,520 their down rows.
REAL_K_CONFIGS = [
    (23040, 64, 2, 2, 4), (23040, 64, 2, 2, 3), (23040, 64, 4, 2, 4), (23040, 128, 2, 4, 4),
    (23040, 128, 4, 4, 3), (11520, 64, 2, 2, 4), (11520, 64, 4, 2, 4), (11520, 32, 2, 2, 4),
    (11520, 128, 4, 2, 4), (11520, 128, 4, 4, 3),
]  # fmt: skip


def real_k_launcher(x, blocks, scales, out, num_rows: int, bn: int, split: int, warps: int,
                    stages: int) -> Callable[[], None]:  # fmt: skip
    """LAYERS launches of _real_k_kernel (one per layer of ``blocks`` / ``scales``) over
    ``num_rows`` rows, K = 2880 cut in ``split`` parts, into ``out``."""
    from gptoss_serve.kernels._moe_small import split_plan  # noqa: PLC0415

    plan = split_plan(2880, split)

    def launch() -> None:
        for layer in range(LAYERS):
            _real_k_kernel[(num_rows * split // bn,)](
                x, blocks[layer], scales[layer], out, BN=bn, SPLIT=split,
                SPLIT_GROUPS=plan["SPLIT_GROUPS"], STEPS=plan["STEPS"],
                FULL_STEPS=plan["FULL_STEPS"], NUM_STAGES=stages, num_warps=warps,
                num_stages=stages,
            )  # fmt: skip

    return launch


def real_k_rows(blocks, scales, x, out) -> list[dict]:
    """Times REAL_K_CONFIGS over 36 layers (rows of 1,440 bytes)."""
    rows = []
    sys.stdout.write(
        f"\n{'K = 2880: rows tile split warps stages':<40} {'us/layer':>9} {'TB/s':>7}\n"
    )
    for num_rows, bn, split, warps, stages in REAL_K_CONFIGS:
        launch = real_k_launcher(x, blocks, scales, out, num_rows, bn, split, warps, stages)
        us = statistics.median(graph_time_ms(launch, calls=LAYERS, repeats=20)) * 1e3
        tbps = num_rows * 1440 * 17 / 16 / (us * 1e-6) / 1e12
        name = f"{num_rows} {bn} {split} {warps} {stages}"
        sys.stdout.write(f"{name:<40} {us:9.2f} {tbps:7.3f}\n")
        rows.append({"config": "K=2880 " + name, "us": round(us, 2), "tbps": round(tbps, 3)})
    return rows


def random_layers(row_bytes: int, row_scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LAYERS layers of ROWS rows: random packed bytes and scales near 127 (finite sums)."""
    blocks = torch.randint(0, 256, (LAYERS, ROWS * row_bytes), dtype=torch.uint8, device="cuda")
    scales = torch.randint(120, 134, (LAYERS, ROWS * row_scales), dtype=torch.uint8,
                           device="cuda")  # fmt: skip
    return blocks, scales


def parse_args(doc: str) -> argparse.Namespace:
    """--out, the probes' one flag; ``doc``: the script's docstring."""
    parser = argparse.ArgumentParser(description=doc.split("\n", maxsplit=1)[0])
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    return parser.parse_args()


def layer_us(name: str, launch) -> float | None:
    """Median us per layer of ``launch`` (LAYERS launches, one CUDA graph); None, reported,
    for a shape that does not build."""
    try:
        return statistics.median(graph_time_ms(launch, calls=LAYERS, repeats=20)) * 1e3
    except Exception as error:  # a shape that does not build: report it, go on
        sys.stdout.write(f"{name}: {error!r}\n")
        return None


def write_rows(path: str | None, rows: list[dict]) -> int:
    """The probes' end: their rows as JSON at ``path`` (--out) when given; exit code 0."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


def main() -> int:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    blocks, scales = random_layers(K_BYTES, K_BYTES // 16)
    x = torch.randn(2 * K_BYTES, device="cuda").to(torch.bfloat16)
    out = torch.empty(ROWS, device="cuda")
    layer_bytes = ROWS * K_BYTES * 17 // 16
    rows = [{"config": "copy (SM kernel)", "tbps": round(copy_tbps(), 3)}]
    sys.stdout.write(f"{'rows split warps stages LB':<28} {'us/layer':>9} {'TB/s':>7}\n")
    for bn, split, warps, stages, lb in CONFIGS:
        steps = K_BYTES // 64 // split

        def launch(bn=bn, split=split, warps=warps, stages=stages, lb=lb, steps=steps) -> None:
            for layer in range(LAYERS):
                _probe_kernel[(ROWS * split // bn,)](
                    x, blocks[layer], scales[layer], out, BN=bn, SPLIT=split, STEPS=steps,
                    NUM_STAGES=stages, LB=lb, K_BYTES=K_BYTES, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip

        us = statistics.median(graph_time_ms(launch, calls=LAYERS, repeats=20)) * 1e3
        tbps = layer_bytes / (us * 1e-6) / 1e12
        name = f"{bn} {split} {warps} {stages} {lb}"
        sys.stdout.write(f"{name:<28} {us:9.2f} {tbps:7.3f}\n")
        rows.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3)})
    sys.stdout.write(f"copy: {rows[0]['tbps']} TB/s\n")
    rows += real_k_rows(blocks, scales, x, out)
    return write_rows(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
