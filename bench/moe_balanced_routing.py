"""What the routing's padding costs the prefill MoE: one 120b layer with random routing
against the same weights routed so that every expert gets exactly T·k/E pairs.

    python bench/moe_balanced_routing.py [--tokens 1024 2048 8192]
                                         [--out bench/results/moe_balanced_routing.json]

The balanced inputs are one-hot on 32 of the H dimensions (token t on dimension (t + c) % 32)
plus small noise, and the router's rows are replaced so that expert e reads only dimension
e // 4: a token's four largest logits are the four experts of its dimension, tied, and each
expert gets T·k/E of the T·k pairs. Timing only (the values are not a model's): the median us
a call of CUDA-graph replays of 4 calls (moe_prefill_tiles.measure), the two routings
alternating, twice each, on the table's tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import torch
from gpu_model import _normal, random_moe_weights
from moe_prefill_tiles import CALLS, measure

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels.moe import mxfp4_moe_flops
from kernels import write_results

logger = logging.getLogger("bench.moe_balanced_routing")
DIMENSIONS = 32  # one-hot dimensions of the balanced inputs: E / k of them


def balanced_inputs(tokens: int, hidden: int, num: int) -> list[torch.Tensor]:
    inputs = []
    t = torch.arange(tokens, device="cuda")
    for c in range(num):
        x = 0.001 * _normal((tokens, hidden), 1.0, "cuda")  # values, not routing
        x[t, (t + c) % DIMENSIONS] += 1.0
        inputs.append(x)
    return inputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 2048, 8192])
    parser.add_argument("--out", type=Path, default=Path("results/moe_balanced_routing.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    experts, hidden = config.num_local_experts, config.hidden_size
    if experts != DIMENSIONS * config.num_experts_per_tok:
        raise SystemExit("the balanced router assumes E = 32 · k")
    router = torch.zeros(experts, hidden, dtype=torch.bfloat16, device="cuda")
    router[torch.arange(experts), torch.arange(experts) // config.num_experts_per_tok] = 1.0
    balanced = dataclasses.replace(
        weights, router_weight=router, router_bias=torch.zeros_like(weights.router_bias)
    )
    rows = []
    for tokens in args.tokens:
        flops = mxfp4_moe_flops(tokens, weights)
        tiles = small.decode_tiles_for(tokens)
        cases = {
            "random": ([_normal((tokens, hidden), 1.0, "cuda") for _ in range(CALLS)], weights),
            "balanced": (balanced_inputs(tokens, hidden, CALLS), balanced),
        }
        for name in ["random", "balanced"] * 2:
            xs, moe = cases[name]
            result = measure(xs, moe, tiles, repeats=8)
            ids = small.mxfp4_moe_decode(xs[0], moe, tiles=tiles).expert_ids
            counts = torch.bincount(ids.flatten().long(), minlength=experts).float()
            row = {"tokens": tokens, "routing": name, "us": round(result["us"], 1),
                   "tflops": round(flops / (result["us"] * 1e-6) / 1e12, 1),
                   "gate_up_us": result["gate_up_us"], "down_us": result["down_us"],
                   "pairs_per_expert_std": round(counts.std().item(), 1),
                   "pairs_per_expert_max": int(counts.max().item())}  # fmt: skip
            logger.info("T %d %-8s %8.1f us %6.1f TFLOP/s gate_up %.1f down %.1f, pairs an "
                        "expert std %.1f max %d", tokens, name, row["us"], row["tflops"],
                        row["gate_up_us"], row["down_us"], row["pairs_per_expert_std"],
                        row["pairs_per_expert_max"])  # fmt: skip
            rows.append(row)
    write_results(args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
