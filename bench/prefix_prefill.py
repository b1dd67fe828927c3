"""An agent's next turn on the engine (synthetic-120b): a prompt whose first ``cached``
tokens are in the prefix cache (the instructions, the history) and ``new`` tokens after them
(a tool's output), timed to its first token beside the same new tokens with nothing cached
and the whole prompt cold; then each once more under torch.profiler, its kernels grouped.

    python bench/prefix_prefill.py [--new 1536 ...] [--cached 0 6144 14336] [--trials 5]
                                   [--out bench/results/prefix_prefill.json]

The engine is built as `gptoss-serve serve` builds it (CUDA graphs, the piecewise prefill
graphs, the default token budget), one request at a time: the figure is a lone session's
turn, its scheduling and host work included (``Scenario.run``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from kernel_breakdown import log_rows, profiled_rows
from torch.profiler import ProfilerActivity, profile

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from kernels import write_results

logger = logging.getLogger("bench.prefix_prefill")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/prefix_prefill.json"))
    parser.add_argument("--new", type=int, nargs="*", default=[1536])
    parser.add_argument("--cached", type=int, nargs="*", default=[0, 6144, 14336])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    weights = synthetic_weights(synthetic_model_config("synthetic-120b"), device="cuda")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8))
    make_core, _, _ = build_engine(weights, config)
    model = weights.config
    # (cached, new): each turn, and the whole prompt of the longest one cold.
    cases = [(cached, new) for new in args.new for cached in args.cached]
    cases += [(0, max(args.cached) + new) for new in args.new]
    rows = []
    for cached, new in cases:
        turn = functools.partial(eb.turn_after_history, make_core, model, cached=cached,
                                 new=new)  # fmt: skip
        turn(seed=seed)  # untimed: any first-use cost of these shapes
        times, hits = [], set()
        for trial in range(args.trials):
            elapsed, hit = turn(seed=seed + 1 + trial)
            times.append(elapsed * 1e3)
            hits.add(hit)
        row = {"cached": cached, "new": new, "cached_tokens": sorted(hits),
               "ms": round(statistics.median(times), 2),
               "trials_ms": [round(t, 2) for t in times]}  # fmt: skip
        logger.info("cached %d + new %d: %.2f ms (%s), cache hits %s", cached, new, row["ms"],
                    ", ".join(f"{t:.1f}" for t in times), sorted(hits))  # fmt: skip
        if not args.no_profile:
            prof = profile(activities=[ProfilerActivity.CUDA])
            spans: dict = {}
            elapsed, _ = turn(seed=seed + 99, around=lambda prof=prof: prof)
            kernels = profiled_rows(prof, 1, elapsed * 1e6, spans)
            log_rows(f"cached {cached} + new {new}", kernels, elapsed * 1e6)
            logger.info("  %s", spans)
            row.update(spans, kernels=kernels[:40])
        rows.append(row)
    logger.info("\n| cached | new | ms (median of %d) | spread | new tok/s |", args.trials)
    logger.info("|---|---|---|---|---|")
    for row in rows:
        logger.info("| %d | %d | %.2f | %.1f-%.1f | %.0f |", row["cached"], row["new"],
                    row["ms"], min(row["trials_ms"]), max(row["trials_ms"]),
                    row["new"] / row["ms"] * 1e3)  # fmt: skip
    write_results(args.out, seed=seed, turns=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
