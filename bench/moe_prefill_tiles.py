"""The prefill MoE (grouped columns on wgmma) under other tiles of its table row, per kernel.

    python bench/moe_prefill_tiles.py --tokens 2048 --variants 'gate_up_stages=4' ...
                                      [--rounds 3] [--out bench/results/moe_prefill_tiles.json]

A variant is comma-separated ``field=value`` pairs of ``_moe_small.DecodeTiles`` replacing
the fields of the table row that serves ``--tokens`` (as bench/step_tiles.py takes them). One
120b layer on 4 random inputs: the median us per call of CUDA-graph replays (each variant
between two runs of the table's row), the gate_up and down kernels' own us (torch.profiler),
and the output's largest difference from the table's relative to its largest value (the same
pairs' sums in another tile shape: equal to the bit, or bf16 rounding where the shapes differ).
``--rounds R`` passes over the variants R times (the H100's clocks move these figures by 5-10%
between runs); past one round a summary line per variant gives the medians over the rounds of
its us and of the table's runs after it, and how much faster the variant is.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import _normal, random_moe_weights
from kernel_breakdown import kernel_times
from step_tiles import parse_variant

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels.moe import mxfp4_moe_flops
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.moe_prefill_tiles")
CALLS = 4


def measure(xs: list, weights, tiles: small.DecodeTiles, repeats: int = 10) -> dict:
    def run() -> list:
        return [small.mxfp4_moe_decode(x, weights, tiles=tiles).out for x in xs]

    us = statistics.median(graph_time_ms(run, calls=CALLS, repeats=repeats)) * 1e3
    kernels = {row["kernel"]: row["us"] / CALLS for row in kernel_times(run, calls=1)}
    return {"us": us, "gate_up_us": kernels.get("_columns_gate_up_kernel"),
            "down_us": kernels.get("_columns_down_kernel"),
            "router_us": _sum_of(kernels, ROUTER_KERNELS),
            "grouping_us": _sum_of(kernels, GROUPING_KERNELS), "out": run()[0]}  # fmt: skip


ROUTER_KERNELS = ("_router_split_kernel", "_router_finish_kernel")
GROUPING_KERNELS = ("_count_kernel", "_block_table_kernel", "_scatter_kernel",
                    "_table_groups_kernel")  # fmt: skip


def _sum_of(kernels: dict, names: tuple[str, ...]) -> float:
    return round(sum(kernels.get(name, 0.0) for name in names), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[2048])
    parser.add_argument("--variants", nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=10, help="timed replays of 4 calls")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the variants (each against the table again): the "
                             "summary compares medians over the rounds")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/moe_prefill_tiles.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    rows = []
    for tokens in args.tokens:
        xs = [_normal((tokens, config.hidden_size), 1.0, "cuda") for _ in range(CALLS)]
        table = small.decode_tiles_for(tokens)
        flops = mxfp4_moe_flops(tokens, weights)
        base = measure(xs, weights, table)
        scale = base["out"].float().abs().max().item()
        first = len(rows)
        for round_, text in itertools.product(range(args.rounds), ["", *args.variants]):
            try:
                tiles = dataclasses.replace(table, **parse_variant(text)) if text else table
            except ValueError as error:  # a tile the table would refuse: report it, go on
                logger.info("T %d %s: %s", tokens, text, str(error)[:100])
                rows.append({"tokens": tokens, "variant": text, "error": str(error)})
                continue
            result = measure(xs, weights, tiles, args.repeats)
            again = measure(xs, weights, table, args.repeats)
            diff = (result["out"].float() - base["out"].float()).abs().max().item() / scale
            row = {"tokens": tokens, "round": round_, "variant": text or "table",
                   "us": round(result["us"], 1),
                   "table_us": round(again["us"], 1),
                   "tflops": round(flops / (result["us"] * 1e-6) / 1e12, 1),
                   "gate_up_us": result["gate_up_us"], "down_us": result["down_us"],
                   "router_us": result["router_us"], "grouping_us": result["grouping_us"],
                   "rel_diff": diff}  # fmt: skip
            logger.info("T %d %-44s %8.1f us (table %8.1f) %6.1f TFLOP/s gate_up %s down %s "
                        "router %s grouping %s diff %.1e", tokens, row["variant"], row["us"],
                        row["table_us"], row["tflops"], row["gate_up_us"], row["down_us"],
                        row["router_us"], row["grouping_us"], diff)  # fmt: skip
            rows.append(row)
        if args.rounds > 1:
            _log_medians(tokens, rows[first:])
    write_results(args.out, rows=rows)
    return 0


def _log_medians(tokens: int, rows: list[dict]) -> None:
    """Per variant, the medians over the rounds of its us and of the table's runs after it."""
    for variant in dict.fromkeys(row["variant"] for row in rows if "us" in row):
        mine = [row for row in rows if row["variant"] == variant and "us" in row]
        us = statistics.median(row["us"] for row in mine)
        table_us = statistics.median(row["table_us"] for row in mine)
        logger.info("T %d median of %d rounds: %-44s %8.1f us (table %8.1f: %+.1f%% faster)",
                    tokens, len(mine), variant, us, table_us,
                    100 * (table_us / us - 1))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
