"""Per-kernel GPU time of the MoE at prefill sizes and of whole decode steps (torch.profiler).

    python bench/kernel_breakdown.py [--out bench/results/kernel_breakdown.json]
                                     [--moe-tokens 2048 8192] [--step-batches 1 64]

The MoE runs eagerly (as the engine's prefill does); the decode step is replayed from its
CUDA graph (PDL: neighbouring kernels overlap, so their durations may add up to more than the
step's wall time, which is given beside them). Kernels are grouped by name and reported in us
per call (per step), largest first, with their share of the sum.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import DecodeStep, random_moe_weights
from torch.profiler import ProfilerActivity, profile

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.moe import mxfp4_moe, mxfp4_moe_flops
from kernels import capture_graph, graph_time_ms, write_results

logger = logging.getLogger("bench.kernel_breakdown")


def kernel_times(fn: Callable[[], object], calls: int, spans: dict | None = None) -> list[dict]:
    """[{kernel, us per call, count per call, share}] of ``calls`` calls of ``fn``; ``spans``
    (optional) gets the GPU's span from the first kernel's start to the last one's end, the
    time inside it when no kernel ran, and the host's span of the calls, in us per call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        host_start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        host_us = (time.perf_counter() - host_start) * 1e6
    return profiled_rows(prof, calls, host_us, spans)


def profiled_rows(prof: profile, calls: int, host_us: float, spans: dict | None) -> list[dict]:
    """kernel_times's rows and spans from a finished profile of ``calls`` calls."""
    totals: dict[str, list[float]] = collections.defaultdict(list)
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]].append(event.device_time)
            intervals.append((event.time_range.start, event.time_range.end))
    if spans is not None and intervals:
        intervals.sort()
        idle, reach = 0.0, intervals[0][0]
        for start, end in intervals:
            idle += max(0.0, start - reach)
            reach = max(reach, end)
        spans.update(
            gpu_span_us=round((reach - intervals[0][0]) / calls, 1),
            gpu_idle_us=round(idle / calls, 1),
            host_us=round(host_us / calls, 1),
        )
    total = sum(sum(v) for v in totals.values())
    rows = [
        {
            "kernel": name,
            "us": round(sum(v) / calls, 2),
            "count": len(v) / calls,
            "share": round(sum(v) / total, 4),
        }
        for name, v in totals.items()
    ]
    return sorted(rows, key=lambda row: -row["us"])


def log_rows(title: str, rows: list[dict], wall_us: float) -> None:
    logger.info("\n%s: wall %.1f us, kernels' sum %.1f us", title, wall_us,
                sum(row["us"] for row in rows))  # fmt: skip
    for row in rows[:20]:
        logger.info("  %9.1f us  %5.1f%%  x%-6g %s", row["us"], 100 * row["share"], row["count"],
                    row["kernel"])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernel_breakdown.json"))
    parser.add_argument("--moe-tokens", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--step-batches", type=int, nargs="*", default=[1, 64])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    moe, steps = [], []
    weights = random_moe_weights(config)
    for tokens in args.moe_tokens:
        x = torch.randn(tokens, config.hidden_size, device="cuda").bfloat16()
        times = graph_time_ms(lambda x=x, w=weights: mxfp4_moe(x, w), repeats=10)
        wall_us = statistics.median(times) * 1e3
        rows = kernel_times(lambda x=x, w=weights: mxfp4_moe(x, w), calls=5)
        tflops = mxfp4_moe_flops(tokens, weights) / (wall_us * 1e-6) / 1e12
        log_rows(f"MoE {tokens} tokens ({tflops:.1f} TFLOP/s)", rows, wall_us)
        moe.append({"tokens": tokens, "wall_us": round(wall_us, 1), "kernels": rows})
    del weights
    torch.cuda.empty_cache()
    for batch in args.step_batches:
        step = DecodeStep(config, batch=batch, context=1024, pdl=True)
        wall_us = statistics.median(graph_time_ms(step, repeats=20)) * 1e3
        graph = capture_graph(step)
        rows = kernel_times(graph.replay, calls=5)
        log_rows(f"decode step, batch {batch}, 1k context", rows, wall_us)
        steps.append({"batch": batch, "wall_us": round(wall_us, 1), "kernels": rows})
        del step, graph
        torch.cuda.empty_cache()
    write_results(args.out, moe=moe, steps=steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
