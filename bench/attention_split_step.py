"""The whole batch-1 120b decode step (PDL, CUDA graph: as bench/kernels.py times it) under other
decode-attention split sizes: ``_attention_decode.GPU_TILES.split_min``, the fewest keys a
split is given, decides how many programs (and whether a combine kernel) a full-attention
layer takes at a given context (1k: 128 -> 8 splits and a combine; 1024 -> one split, none).

    python bench/attention_split_step.py [--contexts 1024 8192] [--split-min 256 512 1024]
                                         [--out bench/results/attention_split_step.json]

Each variant between runs of the default, on the same weights and inputs; logits compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import DecodeStep

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.synthetic_weights import synthetic_weights
from gptoss_serve.kernels import _attention_decode as decode
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.attention_split_step")


def timed(step: DecodeStep, split_min: int) -> tuple[float, torch.Tensor]:
    default = decode.GPU_TILES  # batch 1's row
    decode.GPU_TILES = ((1, dataclasses.replace(decode.gpu_tiles_for(1), split_min=split_min)),
                        *default)  # fmt: skip
    try:
        ms = statistics.median(graph_time_ms(step, repeats=30))
    finally:
        decode.GPU_TILES = default
    return ms, step.last_logits.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 8192])
    parser.add_argument("--split-min", type=int, nargs="*", default=[256, 512, 1024])
    parser.add_argument("--out", type=Path, default=Path("results/attention_split_step.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    seed = int.from_bytes(os.urandom(4), "little")
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = synthetic_weights(config, device="cuda", seed=seed)
    default = decode.gpu_tiles_for(1).split_min
    rows = []
    for context in args.contexts:
        step = DecodeStep(config, batch=1, context=context, weights=weights, seed=seed, pdl=True)
        for split_min in args.split_min:
            before, logits = timed(step, default)
            ms, variant_logits = timed(step, split_min)
            after, _ = timed(step, default)
            row = {"context": context, "split_min": split_min, "ms": round(ms, 4),
                   "default_ms": [round(before, 4), round(after, 4)],
                   "logits_max_diff": (variant_logits - logits).abs().max().item()}  # fmt: skip
            logger.info("%s", row)
            rows.append(row)
        del step
    write_results(args.out, default_split_min=default, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
