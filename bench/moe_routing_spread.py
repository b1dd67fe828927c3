"""How the prefill MoE's speed at 2048 tokens follows its routing: random 120b layers (fresh
seeds) and random inputs, each call's time next to the spread of its pairs over the experts.

    python bench/moe_routing_spread.py [--tokens 2048] [--seeds 6] [--inputs 3]
                                       [--out bench/results/moe_routing_spread.json]

kernels.py times one random layer on one random input a run, and its 2048-token figure moved
between ~225 and ~305 TFLOP/s from run to run with the same kernels (RESULTS v11). Here: per
(layer seed, input) the median of CUDA-graph replays, TFLOP/s, and of the per-expert pair
counts the largest, the standard deviation, the experts past one group of the table's size
plus its extra columns (each costs a second decode of all its weights) and the groups.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import _normal, random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels.moe import mxfp4_moe, mxfp4_moe_flops, route, router_logits_reference
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.moe_routing_spread")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--inputs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="timed graph replays")
    parser.add_argument(
        "--decode-first",
        action="store_true",
        help="each layer first serves graphs of 1-64-token calls, as in kernels.py",
    )
    parser.add_argument("--out", type=Path, default=Path("results/moe_routing_spread.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    tiles = small.decode_tiles_for(args.tokens)
    size, extra = tiles.group_size, tiles.next_group_columns
    rows = []
    for _ in range(args.seeds):
        seed = int.from_bytes(os.urandom(4), "little")
        torch.manual_seed(seed)
        weights = random_moe_weights(config)
        flops = mxfp4_moe_flops(args.tokens, weights)
        if args.decode_first:
            for tokens in (1, 8, 32, 64):
                xs = [_normal((tokens, config.hidden_size), 1.0, "cuda") for _ in range(36)]
                graph_time_ms(lambda xs=xs, w=weights: [mxfp4_moe(x, w) for x in xs], calls=36)
        for index in range(args.inputs):
            x = _normal((args.tokens, config.hidden_size), 1.0, "cuda")
            ids = route(router_logits_reference(x, weights), 4)[1]
            counts = torch.bincount(ids.flatten().long(), minlength=weights.num_experts).float()
            times = graph_time_ms(lambda x=x, w=weights: mxfp4_moe(x, w), repeats=args.repeats)
            us = statistics.median(times) * 1e3
            groups = torch.ceil(counts / size) - ((counts > size) & (counts % size > 0)
                                                  & (counts % size <= extra)).float()  # fmt: skip
            row = {"seed": seed, "input": index, "decode_first": args.decode_first,
                   "us": round(us, 1),
                   "tflops": round(flops / (us * 1e-6) / 1e12, 1),
                   "replays_us": [round(t * 1e3) for t in times],
                   "max_pairs": int(counts.max()), "sd_pairs": round(counts.std().item(), 1),
                   "experts_past_one_group": int((counts > size + extra).sum()),
                   "decoded_groups": int(groups.sum())}  # fmt: skip
            logger.info("%s", row)
            rows.append(row)
        del weights
    write_results(args.out, tokens=args.tokens, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
