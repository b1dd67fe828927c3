"""Per-kernel GPU time of one engine prefill on synthetic-120b (torch.profiler), next to its
wall time: where a 2048-token prompt's 67 ms go besides the MoE.

    python bench/prefill_breakdown.py [--lengths 2048 8192]
                                      [--out bench/results/prefill_breakdown.json]

The engine is built as `gptoss-serve bench` builds it, without CUDA graphs (prefill steps
run eagerly either way; this only skips the decode graphs' capture); each prompt runs to its
first token once untimed, then once timed, then once under the profiler.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
from kernel_breakdown import kernel_times, log_rows

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from kernels import write_results

logger = logging.getLogger("bench.prefill_breakdown")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/prefill_breakdown.json"))
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    weights = synthetic_weights(synthetic_model_config("synthetic-120b"), device="cuda")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8), use_cuda_graphs=False)
    make_core, _, _ = build_engine(weights, config)
    model = weights.config
    prefills = []

    def prefill(length: int, seed: int) -> float:
        """Seconds of the engine's steps (as engine_bench times them)."""
        scenario = eb.Scenario(make_core, model.vocab_size, seed=seed)
        scenario.add("prefill", length, 1)
        return scenario.run()

    for length in args.lengths:
        prefill(length, 1)
        wall_us = prefill(length, 2) * 1e6
        spans: dict = {}
        rows = kernel_times(lambda length=length: prefill(length, 3), calls=1, spans=spans)
        log_rows(f"prefill {length} ({length / wall_us * 1e6:.0f} tok/s)", rows, wall_us)
        logger.info("  %s", spans)
        prefills.append({"tokens": length, "wall_us": round(wall_us, 1), **spans,
                         "kernels": rows})  # fmt: skip
    write_results(args.out, prefills=prefills)
    return 0


if __name__ == "__main__":
    sys.exit(main())
