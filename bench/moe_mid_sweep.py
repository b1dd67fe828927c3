"""Grouped MoE tiles between the decode path (<= 64 tokens) and prefill (H200): T = 96..1024
tokens of a 120b layer, the current tiles against smaller row blocks.

    PYTHONPATH=src python3 bench/moe_mid_sweep.py [--tokens 96,128,256,512,1024]

Median per call over CUDA-graph replays of 36 calls on 36 random inputs (as bench/kernels.py).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gpu_model import random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_triton as grouped
from gptoss_serve.kernels._moe_triton import GemmTiles, MoeTiles
from kernels import graph_time_ms

CALLS = 36
_WIDE = GemmTiles(64, 128, 4, 3)
_NARROW = GemmTiles(32, 256, 4, 3, swap_ab=False)
CANDIDATES = {
    "m16 wide/narrow": MoeTiles(16, _WIDE, _NARROW, small_routing=False),
    "m32 wide/wide": MoeTiles(32, _WIDE, _WIDE, small_routing=False),
    "m32 wide/narrow": MoeTiles(32, _WIDE, _NARROW, small_routing=False),
    "m64 wide/wide": MoeTiles(64, _WIDE, _WIDE, small_routing=False),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="96,128,256,512,1024")
    args = parser.parse_args()
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    print(f"{'T':>5} {'tiles':<18} {'us/call':>9}  vs current")  # noqa: T201
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = [torch.randn(tokens, config.hidden_size, device="cuda").to(torch.bfloat16)
              for _ in range(CALLS)]  # fmt: skip
        cases = {"current": grouped.tiles_for(tokens, config.num_local_experts), **CANDIDATES}
        base = None
        reference = grouped.mxfp4_moe_triton(xs[0], weights, tiles=cases["current"]).float()
        for name, tiles in cases.items():
            try:
                check = grouped.mxfp4_moe_triton(xs[0], weights, tiles=tiles).float()
                error = ((check - reference).abs().max() / reference.abs().max()).item()
                times = graph_time_ms(
                    lambda tiles=tiles, xs=xs: [grouped.mxfp4_moe_triton(x, weights, tiles=tiles)
                                         for x in xs], calls=CALLS, repeats=10)  # fmt: skip
            except Exception as error_:
                print(f"{tokens:>5} {name:<18} failed: {str(error_)[:80]}")  # noqa: T201
                continue
            median = 1e3 * statistics.median(times)
            base = base or median
            print(f"{tokens:>5} {name:<18} {median:9.1f}  {base / median:5.2f}x  err {error:.1e}")  # noqa: T201


if __name__ == "__main__":
    main()
