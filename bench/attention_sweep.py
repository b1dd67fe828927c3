"""Decode-attention launch-shape sweep on the GPU (H200): splits per SM, the split cap, keys per
tile, pipeline stages and warps, at batch 1 (1k to 128k context) and batch 32 (32k).

    python bench/attention_sweep.py [--out bench/results/attention_sweep.json] [--pdl]
                                    [--variants 4,64,128,4,4 ...] [--cases 1:1024 8:1024 ...]

A variant is (programs per SM, split cap, block_n, stages, warps); a case is batch:context.

Each variant replaces the module's tile constants for its run (the kernels read them at launch),
then the same CUDA-graph timing as bench/kernels.py: KV bytes / median time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _attention_decode as decode
from kernels import attention_decode_tbps, copy_tbps

# (programs per SM, split cap, block_n, num_stages, num_warps); the first is the default.
# Measured (results/attention_sweep.json, plain launches): more programs per SM, other tiles
# and 2 warps all lost at bs1 32k; --pdl times them as the engine launches them.
VARIANTS = [
    (4, 64, 64, 5, 4), (8, 128, 64, 5, 4), (16, 256, 64, 5, 4), (8, 128, 64, 3, 4),
    (8, 128, 128, 3, 4), (8, 128, 32, 5, 4), (4, 64, 128, 3, 8), (8, 128, 64, 5, 2),
]  # fmt: skip
PDL_VARIANTS = [
    (4, 64, 64, 5, 4), (4, 64, 64, 4, 4), (4, 64, 64, 6, 4), (3, 64, 64, 5, 4),
    (6, 64, 64, 5, 4), (4, 64, 128, 4, 4), (4, 64, 64, 5, 8), (2, 32, 64, 5, 4),
]  # fmt: skip
CASES = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (32, 32768)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results/attention_sweep.json"
    )
    parser.add_argument(
        "--pdl", action="store_true", help="PDL_VARIANTS as the engine launches them (PDL)"
    )
    parser.add_argument("--variants", nargs="*", default=None, help="instead of the lists")
    parser.add_argument("--cases", nargs="*", default=None, help="batch:context, not CASES")
    args = parser.parse_args()
    cases = CASES
    if args.cases:
        cases = [tuple(int(v) for v in case.split(":")) for case in args.cases]
    variants = PDL_VARIANTS if args.pdl else VARIANTS
    if args.variants:
        variants = [tuple(int(v) for v in text.split(",")) for text in args.variants]
    config = ModelConfig.from_dict(preset_config("120b"))
    copy = copy_tbps()
    default = (decode.MAX_SPLITS, decode.GPU_TILES)
    rows = []
    for variant in variants:
        pps, cap, block_n, stages, warps = variant
        decode.MAX_SPLITS = cap
        tiles = decode.DecodeTiles(
            block_n=block_n, split_min=max(128, block_n), num_warps=warps, num_stages=stages,
            programs_per_sm=pps,
        )  # fmt: skip
        decode.GPU_TILES = ((1 << 30, tiles),)  # every batch
        tbps = [round(attention_decode_tbps(config, b, c, pdl=args.pdl), 3) for b, c in cases]
        rows.append({"variant": list(variant), "tbps": tbps})
        torch.cuda.empty_cache()
    decode.MAX_SPLITS, decode.GPU_TILES = default
    result = {"device": torch.cuda.get_device_name(), "copy_tbps": round(copy, 3),
              "pdl": args.pdl, "cases": cases, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    header = " ".join(f"bs{b} {c // 1024}k".rjust(10) for b, c in cases)
    sys.stdout.write(f"\ncopy {copy:.2f} TB/s\n{'pps,cap,block_n,stages,warps':30} {header}\n")
    for row in rows:
        cells = " ".join(f"{t:10.2f}" for t in row["tbps"])
        sys.stdout.write(f"{','.join(map(str, row['variant'])):30} {cells}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
