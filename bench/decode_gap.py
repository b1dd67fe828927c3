"""Where a concurrent engine decode step's wall time goes (GPU machine): the host's step time
against the device's busy time, its idle gaps and its kernels.

    cd bench && python3 decode_gap.py [--batch 64] [--context 1024] [--steps 40]
                                      [--out results/decode_gap.json] [--qkv-mma-max-tokens N]
                                      [--variant moe:gate_up_rows=128,gate_up_warps=4]

As `gptoss-serve bench` times ``decode_conc<B>_tok_s``: B requests of ``--context`` random prompt
tokens, temperature 1, top_p 1, a seed each, every prefill and first token first; then
``--steps`` engine steps (``EngineCore.step``, async scheduling as the engine runs) timed on
the host (one at a time: with async scheduling a step's host time is bimodal, so the mean is
the rate; and as many again after the profile, to tell the order's effect from the
profiler's; each with the board's power state through NVML, benchmarks/power.py),
and as many again under torch.profiler (CUDA activity only): the union of the
kernels' intervals against the profiled window (the device's busy share), the idle gaps of
more than 5 us between kernels (count and time a step), and each kernel's time a step.

``--variant TARGET:FIELDS`` runs the engine under another table row, as bench/step_tiles.py
varies the whole step (TARGET moe, attention, dense or norm; FIELDS as its ``--variants``),
for the batch's row: an A/B in the engine itself, where 32-64 sequences decode at the card's
power cap and the bench's figures move by up to 7% between runs (bench/RESULTS.md e36). Each
run builds a fresh engine; alternate the runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import step_tiles
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.benchmarks.power import power_meter
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from gptoss_serve.kernels import rope

logger = logging.getLogger("bench.decode_gap")
GAP_US = 5.0  # idle stretches shorter than this are a kernel boundary, not a gap


def device_timeline(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and copy the profiler saw, by start."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA]  # fmt: skip
    return sorted(spans)


def busy_and_gaps(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """The union of the spans' time, the window, and the idle stretches longer than GAP_US."""
    busy, gaps, gap_count = 0.0, 0.0, 0
    run_start, run_end = spans[0][0], spans[0][1]
    for start, end, _ in spans[1:]:
        if start > run_end:
            busy += run_end - run_start
            if start - run_end > GAP_US:
                gaps += start - run_end
                gap_count += 1
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    return {"window_us": run_end - spans[0][0], "busy_us": busy, "gaps_us": gaps,
            "gap_count": gap_count}  # fmt: skip


def timed_steps(scenario: eb.Scenario, steps: int) -> tuple[list[float], dict | None]:
    """Each of ``steps`` engine steps' host time (us), and the board's power state over them
    (benchmarks/power.py, with the energy a step; None without NVML)."""
    meter = power_meter(torch.device("cuda"))
    walls = []
    with meter or contextlib.nullcontext():
        for _ in range(steps):
            started = time.perf_counter()
            scenario.step()
            walls.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
    if meter is None:
        return walls, None
    reading = meter.reading()
    return walls, reading | {"mj_per_step": round(1e3 * reading["joules"] / steps, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("results/decode_gap.json"))
    parser.add_argument("--qkv-mma-max-tokens", type=int, default=None,
                        help="rope.QKV_MMA_MAX_TOKENS for this run (an A/B of the fused "
                             "tensor-core q/k/v against cuBLAS and the RoPE kernel): "
                             "--variant dense:qkv_max_tokens=N")  # fmt: skip
    parser.add_argument("--variant", default=None,
                        help="TARGET:field=value,... (moe, attention or dense; step_tiles.py's "
                             "variants) for the table row serving --batch")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    variants: dict[str, dict] = {}
    if args.variant:
        try:
            target, fields = step_tiles.split_target(args.variant, None)
        except ValueError as error:
            parser.error(str(error))
        variants[target] = step_tiles.parse_variant(fields)
    if args.qkv_mma_max_tokens is not None:
        dense = variants.setdefault("dense", {})
        if "qkv_max_tokens" in dense:
            parser.error("--qkv-mma-max-tokens and --variant dense:qkv_max_tokens=... both given")
        dense["qkv_max_tokens"] = args.qkv_mma_max_tokens
    for target, fields in variants.items():
        step_tiles.apply(target, args.batch, fields)
    weights = synthetic_weights(synthetic_model_config("synthetic-120b"), device="cuda")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=args.batch))
    make_core, _, _ = build_engine(weights, config)
    scenario = eb.Scenario(make_core, weights.config.vocab_size, seed=args.batch * 7919)
    for index in range(args.batch):
        scenario.add(f"decode-{index}", args.context, 3 * args.steps + 16)
    while len(scenario.first_token_at) < args.batch:
        scenario.step()
    for _ in range(5):  # past the first decode steps
        scenario.step()
    torch.cuda.synchronize()
    walls, power = timed_steps(scenario, args.steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            scenario.step()
        torch.cuda.synchronize()
        profiled_wall = (time.perf_counter() - started) * 1e6
    # the same steps timed again after the profiled ones: is the order the cause?
    after, power_after = timed_steps(scenario, args.steps)
    spans = device_timeline(prof)
    timeline = busy_and_gaps(spans)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for start, end, name in spans:
        per_kernel[name] += (end - start) / args.steps
    step_us = statistics.median(walls)
    result = {
        "device": torch.cuda.get_device_name(), "batch": args.batch, "context": args.context,
        "steps": args.steps, "qkv_mma_max_tokens": rope.QKV_MMA_MAX_TOKENS,
        "variant": args.variant,
        "host_step_us_median": round(step_us, 1),
        "host_step_us_mean": round(statistics.mean(walls), 1),
        "host_step_us_spread": [round(min(walls), 1), round(max(walls), 1)],
        "tok_s": round(args.batch / statistics.mean(walls) * 1e6, 1),
        "host_step_us_mean_after_profile": round(statistics.mean(after), 1),
        "power": power, "power_after_profile": power_after,
        "profiled_step_us": round(profiled_wall / args.steps, 1),
        "device_busy_us_per_step": round(timeline["busy_us"] / args.steps, 1),
        "device_window_us_per_step": round(timeline["window_us"] / args.steps, 1),
        "gaps_us_per_step": round(timeline["gaps_us"] / args.steps, 1),
        "gaps_per_step": round(timeline["gap_count"] / args.steps, 2),
        "kernels_us_per_step": {name: round(us, 1) for name, us in
                                sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]},
    }  # fmt: skip
    out = sys.stdout
    out.write(f"batch {args.batch}, {args.context} context: host step median {step_us:.1f} us "
              f"(mean {result['host_step_us_mean']}: {result['tok_s']} tok/s; "
              f"{min(walls):.0f}-{max(walls):.0f}; after the profile: mean "
              f"{result['host_step_us_mean_after_profile']}); profiled "
              f"{result['profiled_step_us']} us a step, device busy "
              f"{result['device_busy_us_per_step']} us of a {result['device_window_us_per_step']}"
              f" us window, {result['gaps_per_step']} gaps > {GAP_US:.0f} us a step "
              f"({result['gaps_us_per_step']} us)\n"
              f"power (before / after the profile): {power} / {power_after}\n")  # fmt: skip
    for name, us in list(result["kernels_us_per_step"].items())[:15]:
        out.write(f"  {us:9.1f} us  {name[:90]}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
