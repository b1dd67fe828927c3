"""The grouped-columns MoE (_moe_columns.py) at 64-8192 tokens against the grouped GEMMs, over
group sizes, tiles and activation order (H200): where the decode path's table rows past 128
tokens and DECODE_MAX_TOKENS come from. One 120b layer, us per call (median of graph replays
of 4 calls on 4 inputs), TFLOP/s of the routed experts' GEMMs, and the grouping kernel alone.

    cd bench && python3 moe_prefill_columns.py [--tokens 512,1024,2048,8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys

import torch
from gpu_model import _normal, random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels import _moe_triton as grouped
from kernels import graph_time_ms

logger = logging.getLogger(__name__)
CALLS = 4
# (group_size, gate_up rows, down rows, warps, stages, activation order: 0 thread, 1 tile
# order for mma.sync, 2 tile order for wgmma[, scale words: default with order 2]). --all
# adds the older thread / mma.sync ones; --small the 17-128-token rows and their variants.
VARIANTS = [
    (32, 64, 64, 2, 3, 1), (32, 128, 128, 8, 3, 2), (32, 128, 128, 4, 3, 2),
    (64, 128, 128, 4, 3, 2), (64, 128, 128, 4, 4, 2), (128, 128, 128, 8, 2, 2),
    (16, 128, 128, 4, 3, 2), (128, 256, 256, 8, 2, 2), (32, 64, 64, 4, 3, 2),
    (16, 64, 64, 2, 4, 1), (8, 128, 128, 4, 3, 2), (16, 128, 128, 4, 4, 2),
]  # fmt: skip
SMALL_VARIANTS = [
    (8, 64, 64, 2, 4, 0, False), (8, 64, 64, 2, 4, 0, True), (8, 64, 64, 2, 4, 1, True),
    (16, 128, 128, 4, 4, 2), (8, 128, 128, 4, 4, 2), (16, 64, 64, 2, 4, 1, True),
]  # fmt: skip
OLD_VARIANTS = [
    (8, 128, 128, 4, 4, 0), (8, 128, 128, 4, 4, 1), (8, 64, 64, 2, 4, 1), (16, 64, 64, 2, 4, 1),
    (32, 64, 64, 2, 3, 0), (32, 64, 64, 4, 3, 1), (32, 128, 128, 4, 3, 1), (64, 64, 64, 2, 3, 1),
    (64, 128, 128, 4, 3, 1), (64, 128, 128, 8, 3, 1),
]  # fmt: skip


def timed(fn) -> float:
    times = graph_time_ms(lambda: [fn(i) for i in range(CALLS)], calls=CALLS, repeats=10)
    return statistics.median(times) * 1e3


def group_only(ids: torch.Tensor, cols: int) -> None:
    tiles = dataclasses.replace(small.decode_tiles_for(384), group_size=cols)
    small.group(ids, 128, tiles)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="512,1024,2048,8192")
    parser.add_argument("--all", action="store_true", help="also the older variants")
    parser.add_argument("--no-grouped", action="store_true", help="skip the grouped GEMMs")
    parser.add_argument("--small", action="store_true", help="the 17-128-token variants")
    args = parser.parse_args()
    variants = (SMALL_VARIANTS if args.small else VARIANTS) + (OLD_VARIANTS if args.all else [])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    flop_per_token = 4 * 2 * (2880 * 5760 + 2880 * 2880)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = [_normal((tokens, 2880), 1.0, "cuda") for _ in range(CALLS)]
        tiles = grouped.tiles_for(tokens, 128)
        if not args.no_grouped:
            us = timed(lambda i, t=tiles, xs=xs: grouped.mxfp4_moe_triton(xs[i], weights, tiles=t))
            rows.append((tokens, "grouped GEMMs", us))
        ref = grouped.mxfp4_moe_triton(xs[0], weights, tiles=tiles).double()
        ids = [grouped.route_triton(x, weights, top_k=4, tiles=tiles)[0] for x in xs]
        for cols in (8, 32, 128):
            us = timed(lambda i, ids=ids, c=cols: group_only(ids[i], c))
            rows.append((tokens, f"group kernel alone, {cols} columns", us))
        for cols, gu_rows, down_rows, warps, stages, order, *words in variants:
            scale_words = words[0] if words else order == 2
            t = dataclasses.replace(
                small.decode_tiles_for(384), group_size=cols, gate_up_rows=gu_rows,
                down_rows=down_rows, gate_up_warps=warps, down_warps=warps,
                gate_up_stages=stages, down_stages=stages, tile_order=order > 0,
                wgmma_order=order == 2, scale_words=scale_words,
            )  # fmt: skip
            try:
                us = timed(lambda i, t=t, xs=xs: small.mxfp4_moe_decode(xs[i], weights, tiles=t))
                out = small.mxfp4_moe_decode(xs[0], weights, tiles=t).out.double()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:  # a tile that does not compile: report, go on
                logger.warning("T=%d %s: %s", tokens, t, exc)
                continue
            name = ("thread", "tile", "wgmma")[order] + (" words" if scale_words else "")
            rows.append((tokens, f"columns {cols} {gu_rows}/{down_rows} w{warps} s{stages} {name} "
                         f"(max_rel {err:.1e})", us))  # fmt: skip
        torch.cuda.empty_cache()
    out = sys.stdout
    out.write(f"{'T':>5} {'us':>9} {'TFLOP/s':>8}  path\n")
    for tokens, name, us in rows:
        out.write(
            f"{tokens:5d} {us:9.1f} {tokens * flop_per_token / (us * 1e-6) / 1e12:8.1f}  {name}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
