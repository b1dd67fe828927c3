"""The whole 120b decode step (PDL, CUDA graph: as bench/kernels.py times it) with the MoE blocks
in the kernels' step-rows layout (kernels/mxfp4_layout.py, what the engine loads on CUDA)
against the checkpoint's own rows, alternating twice per batch size; the logits must be the
same bits (only the addresses differ).

    cd bench && python3 step_layout.py [--batch 1 8 32 64] [--rows 16]
                                       [--out results/moe_layout_step.json]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import DecodeStep

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.step_layout")


def relay(step: DecodeStep, rows: int) -> None:
    """The step's MoE blocks into bands of ``rows``, in place, a layer at a time (a second
    copy of the 120b experts would not fit beside the first)."""
    for layer in step.weights.layers:
        object.__setattr__(layer, "moe", layer.moe.with_step_rows(rows))  # frozen: swap only
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16, help="the step rows against 1")
    parser.add_argument("--out", type=Path, default=Path("results/moe_layout_step.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    weights, rows = None, []
    for batch in args.batch:
        step = DecodeStep(config, batch=batch, context=args.context, pdl=True, weights=weights)
        times: dict[int, list[float]] = {args.rows: [], 1: []}
        logits = {}
        for layout in (args.rows, 1, args.rows, 1):
            if step.weights.layers[0].moe.step_rows != layout:
                relay(step, layout)
            times[layout].append(round(statistics.median(graph_time_ms(step, repeats=30)), 4))
            logits[layout] = step.last_logits.clone()
        row = {"batch": batch, "context": args.context,
               f"ms_step_rows_{args.rows}": times[args.rows], "ms_checkpoint_rows": times[1],
               "same_logits": bool(torch.equal(logits[args.rows], logits[1]))}  # fmt: skip
        logger.info("%s", row)
        rows.append(row)
        weights = step.weights
        del step
    write_results(args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
