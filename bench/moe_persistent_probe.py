"""Does a persistent batch-1 MoE GEMV, one software pipeline running through many row tiles,
beat one short program per tile? (H200)

The decode gate_up at T = 1 runs 360 programs of 12 steps, about one wave: each program fills
its cp.async pipeline, streams, drains, and the SM idles in between. Here the same GEMV (same
decode, same tiles, K = 2880 cut as the kernels cut it) runs on a fixed grid of programs
that take tiles p, p + G, p + 2G, ... in one flattened loop over (tile, step), so the
pipeline's loads run ahead across tile boundaries; each step's scales come through the same
pipeline (scale words). 36 layers of the 4 routed experts' gate_up rows (23,040 rows of 1,440
bytes + 90 scales), one launch per layer in a CUDA graph, against the one-program-per-tile
kernel of moe_layout_probe.py on the same bytes; outputs compared. Then the bytes alone (no
decode, no MMA) on the per-tile grid, and torch's sum of them: what the structure can reach.

    cd bench && python3 moe_persistent_probe.py [--out results/moe_persistent_probe.json]
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from moe_layout_probe import LAYERS, ROWS, _real_k_kernel, parse_args, random_layers, write_rows

from gptoss_serve.kernels._moe_gemv import _gemv_step, _scale_words, _tile_slots
from gptoss_serve.kernels._moe_small import split_plan
from kernels import copy_tbps, graph_time_ms

ROW_BYTES, ROW_SCALES = 1440, 90
_ROW_BYTES, _ROW_SCALES = tl.constexpr(ROW_BYTES), tl.constexpr(ROW_SCALES)  # in the kernel
# Per tile kernel (moe_layout_probe): (rows per tile, split, warps, stages); the first is the
# T = 1 gate_up row of the table.
PER_TILE = [(128, 2, 4, 3), (64, 2, 2, 3)]
# Persistent: (rows per tile, split, warps, stages, programs per SM)
# (Unsplit K, split 1, gave other outputs than the per-tile kernel on the H200 and was dropped
# unexplained; it was also the slowest: 28-29 us a layer.)
PERSISTENT = [
    (128, 2, 4, 3, 3), (128, 2, 4, 4, 2), (128, 2, 4, 6, 1), (128, 2, 4, 8, 1),
    (128, 2, 8, 4, 1), (64, 2, 2, 4, 3), (64, 2, 2, 6, 2), (64, 2, 4, 4, 3),
]  # fmt: skip


@triton.jit
def _persistent_kernel(x_ptr, blocks_ptr, scales_ptr, out_ptr, num_tiles,
                       BN: tl.constexpr, SPLIT: tl.constexpr, SPLIT_GROUPS: tl.constexpr,
                       STEPS: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """out[tile rows] for tiles pid, pid + G, ... (G programs): one loop over (tile, step)."""
    R: tl.constexpr = BN // SPLIT
    G: tl.constexpr = 90  # groups of K = 2880
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    my_tiles = (num_tiles - pid + num_programs - 1) // num_programs
    rows, t = _tile_slots(BN)
    part = rows // R
    first_group = part * SPLIT_GROUPS + t
    row_groups = tl.minimum(G - part * SPLIT_GROUPS, SPLIT_GROUPS)
    cols = tl.arange(0, 8)
    col_part = cols % SPLIT
    col_ptrs = x_ptr + col_part * (32 * SPLIT_GROUPS)
    col_groups = tl.minimum(G - col_part * SPLIT_GROUPS, SPLIT_GROUPS)
    keep = (tl.arange(0, BN) // R)[:, None] == cols[None, :]  # row s·R + r: column s alone
    acc = tl.zeros([BN, 8], tl.float32)
    for it in tl.range(0, my_tiles * STEPS, num_stages=NUM_STAGES):
        tile = pid + (it // STEPS) * num_programs
        step = it % STEPS
        row = (tile * R + rows % R).to(tl.int64)
        block_rows = blocks_ptr + row * _ROW_BYTES + 16 * first_group
        word_ptrs, shift = _scale_words(scales_ptr, row * _ROW_SCALES + first_group)
        acc, _, _ = _gemv_step(
            acc, tl.zeros_like(row_groups), step, block_rows, word_ptrs, row_groups, t,
            col_ptrs, col_groups, BN, True, True, False, 0, True, shift,
        )  # fmt: skip
        if step == STEPS - 1:
            y = tl.sum(tl.reshape(tl.sum(tl.where(keep, acc, 0.0), axis=1), [SPLIT, R]), axis=0)
            tl.store(out_ptr + tile * R + tl.arange(0, R), y)
            acc = tl.zeros([BN, 8], tl.float32)


@triton.jit
def _stream_kernel(blocks_ptr, out_ptr, ROWS_PER_PROGRAM: tl.constexpr, WORDS: tl.constexpr,
                   NUM_STAGES: tl.constexpr):  # fmt: skip
    """The same bytes with no decode and no MMA: each program XORs its rows' 32-bit words,
    WORDS of each row per step (16: the GEMV's 64 bytes), in a pipelined loop (whole steps
    only: the last 32 bytes of a row are skipped at 16 words)."""
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    words = blocks_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * (1440 // 4)
    acc = tl.zeros([ROWS_PER_PROGRAM, WORDS], tl.int32)
    for step in tl.range(0, 1440 // 4 // WORDS, num_stages=NUM_STAGES):
        acc ^= tl.load(words + step * WORDS + tl.arange(0, WORDS)[None, :])
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(tl.float32))


def stream_rows(blocks, out) -> list[dict]:
    """Upper bounds of the per-tile structure: the bytes alone (Triton), and torch's sum."""
    layer_bytes = ROWS * ROW_BYTES
    rows = []
    configs = [("triton", 64, 16, 4, 3), ("triton", 64, 8, 4, 3), ("triton", 32, 8, 4, 4),
               ("triton", 64, 16, 8, 4), ("torch", 0, 0, 0, 0)]  # fmt: skip
    for kind, per_program, words, warps, stages in configs:

        def launch(per_program=per_program, words=words, warps=warps, stages=stages,
                   kind=kind) -> None:  # fmt: skip
            for layer in range(LAYERS):
                if kind == "torch":
                    out[:1] = blocks[layer].view(torch.float32).sum()
                else:
                    _stream_kernel[(ROWS // per_program,)](
                        blocks[layer], out, ROWS_PER_PROGRAM=per_program, WORDS=words,
                        NUM_STAGES=stages, num_warps=warps, num_stages=stages,
                    )  # fmt: skip

        us = statistics.median(graph_time_ms(launch, calls=LAYERS, repeats=20)) * 1e3
        name = f"stream {kind} {per_program} rows {words * 4} B/step {warps} warps {stages} st"
        read = layer_bytes if kind == "torch" else ROWS * (ROW_BYTES // 4 // words) * words * 4
        tbps = read / (us * 1e-6) / 1e12
        sys.stdout.write(f"{name:<44} {us:9.2f} {tbps:7.3f}\n")
        rows.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3)})
    return rows


def main() -> int:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, scales = random_layers(ROW_BYTES, ROW_SCALES)
    x = torch.randn(2880, device="cuda").to(torch.bfloat16)
    # Thread order is a permutation within blocks of 8: random values need no reordering.
    layer_bytes = ROWS * (ROW_BYTES + ROW_SCALES)
    results = [{"config": "copy (SM kernel)", "tbps": round(copy_tbps(), 3)}]
    reference = None
    sys.stdout.write(f"{'kernel rows split warps stages programs':<44} {'us/layer':>9} "
                     f"{'TB/s':>7} {'out':>6}\n")  # fmt: skip
    configs = [("tile", *c, None) for c in PER_TILE] + [("persistent", *c) for c in PERSISTENT]
    for kind, bn, split, warps, stages, per_sm in configs:
        plan = split_plan(2880, split)
        num_tiles = ROWS * split // bn
        out = torch.full((ROWS,), float("nan"), device="cuda")
        grid = num_tiles if per_sm is None else min(num_tiles, per_sm * sms)

        def launch(bn=bn, split=split, warps=warps, stages=stages, plan=plan, out=out,
                   grid=grid, num_tiles=num_tiles, kind=kind) -> None:  # fmt: skip
            for layer in range(LAYERS):
                if kind == "tile":
                    _real_k_kernel[(grid,)](
                        x, blocks[layer], scales[layer], out, BN=bn, SPLIT=split,
                        SPLIT_GROUPS=plan["SPLIT_GROUPS"], STEPS=plan["STEPS"],
                        FULL_STEPS=plan["FULL_STEPS"], NUM_STAGES=stages, num_warps=warps,
                        num_stages=stages,
                    )  # fmt: skip
                else:
                    _persistent_kernel[(grid,)](
                        x, blocks[layer], scales[layer], out, num_tiles, BN=bn, SPLIT=split,
                        SPLIT_GROUPS=plan["SPLIT_GROUPS"], STEPS=plan["STEPS"],
                        NUM_STAGES=stages, num_warps=warps, num_stages=stages,
                    )  # fmt: skip

        try:
            us = statistics.median(graph_time_ms(launch, calls=LAYERS, repeats=20)) * 1e3
        except Exception as error:  # a shape that does not build: report it, go on
            sys.stdout.write(f"{kind} {bn} {split} {warps} {stages} {per_sm}: {error!r}\n")
            continue
        if reference is None:
            reference = out.clone()
        same = "same" if torch.equal(out, reference) else (
            f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"
        )  # fmt: skip
        tbps = layer_bytes / (us * 1e-6) / 1e12
        name = f"{kind} {bn} {split} {warps} {stages} {per_sm or '-'}"
        sys.stdout.write(f"{name:<44} {us:9.2f} {tbps:7.3f} {same:>6}\n")
        results.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3),
                        "output": same})  # fmt: skip
    results += stream_rows(blocks, torch.empty(ROWS, device="cuda"))
    sys.stdout.write(f"copy: {results[0]['tbps']} TB/s\n")
    return write_rows(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
