"""Where one engine prefill's wall time goes besides its kernels, without a profiler: the host
before the forward pass, the host issuing it, the device running it, and what follows.

    python bench/prefill_gap.py [--lengths 2048 8192] [--trials 7] [--profile-host DIR]
                                [--graphs] [--piecewise-max-tokens N]
                                [--ab-pieces | --ab-launch | --ab-warm]
                                [--out bench/results/prefill_gap.json]

Each prompt runs to its first token as `gptoss-serve bench` times it (``Scenario.run``), with
CUDA events around the runner's forward call, in two ways taken in turn:

- **paced**: as the bench runs it. ``pre`` is the host from the step's start to the forward
  call, ``issue`` the host inside the forward call, ``gpu`` the device from the forward call
  to its last kernel (idle included where the host fell behind), ``post`` the rest.
- **queued**: the device is first held busy by a sleep kernel, so the whole forward pass is
  queued before it starts: ``issue`` is the host's own cost of issuing it (a hidden host
  sync would show here as the sleep's length), and ``gpu`` the kernels back to back.

``paced gpu - queued gpu`` is what the host's pace costs the device; ``wall - queued gpu`` is
everything the kernels do not explain. ``--ab-pieces`` (with the graphs) also runs each trial
eagerly instead of on the piecewise graphs, ``--ab-launch`` with every Triton launch through
Triton's binding (kernels/fast_launch.py off), ``--ab-warm`` paced right after ~200 ms of
matmuls (is the paced run's slower device the idle device's clocks?); the ways alternate
within the process.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import logging
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from gptoss_serve.kernels import fast_launch
from kernels import write_results

logger = logging.getLogger("bench.prefill_gap")

TIMED_OPS = ("linear", "fused_add_rms_norm", "qkv_rope_and_cache_write", "attention_prefill",
             "moe")  # fmt: skip
SLEEP_CYCLES = 400_000_000  # ~200 ms at the H200's clock: longer than any issue here


class ForwardTimer:
    """Wraps ``runner.forward``: host times and CUDA events of its calls; and every norm call
    inside them (two a layer and the final one), the host's time and an event when issued."""

    def __init__(self, runner, *, queued: bool = False) -> None:
        self.runner = runner
        self.inner = runner.forward
        self.ops = runner.ops
        self.queued = queued
        self.calls: list[tuple[float, float, torch.cuda.Event, torch.cuda.Event]] = []
        self.marks: list[tuple[float, torch.cuda.Event]] = []
        self.host_s = dict.fromkeys(TIMED_OPS, 0.0)

    def _timed(self, name: str):
        inner = getattr(self.ops, name)

        def timed(*args, **kwargs):
            if name == "fused_add_rms_norm":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append((time.perf_counter(), event))
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            self.host_s[name] += time.perf_counter() - started
            return result

        return timed

    def __call__(self, *args, **kwargs):
        if self.queued:
            torch.cuda._sleep(SLEEP_CYCLES)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        start.record()
        result = self.inner(*args, **kwargs)
        stop.record()
        self.calls.append((host_start, time.perf_counter(), start, stop))
        return result

    def __enter__(self) -> ForwardTimer:
        self.runner.forward = self
        self.runner.ops = dataclasses.replace(
            self.ops, **{name: self._timed(name) for name in TIMED_OPS}
        )
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.forward  # the class's method again
        self.runner.ops = self.ops

    def timeline(self) -> list[tuple[float, float]]:
        """(host ms, device ms) of each norm call of the first forward call, from its start."""
        host_start, _, start, _ = self.calls[0]
        return [((host - host_start) * 1e3, start.elapsed_time(event))
                for host, event in self.marks]  # fmt: skip


def warm_device(milliseconds: float = 200.0) -> None:
    """Tensor-core work for about ``milliseconds``, finished before returning: the device
    comes out of it busy, as under load, not idle as between the bench's requests."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    stop.record()
    torch.cuda.synchronize()
    for _ in range(max(1, int(milliseconds / max(start.elapsed_time(stop), 1e-3)))):
        a @ a
    torch.cuda.synchronize()


def one_prefill(make_core, vocab_size: int, length: int, seed: int, *, queued: bool,
                runner, warm: bool = False) -> dict:  # fmt: skip
    scenario = eb.Scenario(make_core, vocab_size, seed=seed)
    scenario.add("prefill", length, 1)
    if warm:
        warm_device()
    with ForwardTimer(runner, queued=queued) as timer:
        started = time.perf_counter()
        wall = scenario.run()
    torch.cuda.synchronize()
    host_start, host_stop, start, stop = timer.calls[0]
    gpu_ms = start.elapsed_time(stop)
    pre_ms = (host_start - started) * 1e3
    figures = {"wall_ms": wall * 1e3, "pre_ms": pre_ms, "issue_ms": (host_stop - host_start) * 1e3,
               "gpu_ms": gpu_ms, "forward_calls": len(timer.calls),
               **{f"host_{name}_ms": s * 1e3 for name, s in timer.host_s.items()}}  # fmt: skip
    if not queued:
        figures["post_ms"] = wall * 1e3 - pre_ms - gpu_ms
    return figures, timer.timeline()


def log_timeline(lines: dict[str, list[tuple[float, float]]]) -> None:
    """Each layer's input norm: when the host issued it and when the device reached it."""
    paced, queued = lines["paced"], lines["queued"]
    logger.info("  norm call   paced host / device ms   queued device ms")
    for index in (*range(0, 8), 10, 20, 40, 60, 70, len(paced) - 1):
        if index < min(len(paced), len(queued)):
            logger.info("  %9d   %10.2f / %8.2f   %14.2f", index, paced[index][0], paced[index][1],
                        queued[index][1])  # fmt: skip


def profile_host(folder: Path, length: int, run) -> None:
    """cProfile of ``run`` (a queued prefill: the host never waits for the device), its top
    functions by own time and by cumulative time into ``folder``/host_<length>.txt."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    folder.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    (folder / f"host_{length}.txt").write_text(text.getvalue())


def host_cpu() -> str:
    """The host's CPU model (its speed sets how fast a forward pass is issued)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def summarise(trials: list[dict]) -> dict:
    keys = trials[0].keys()
    return {key: {"median": round(statistics.median(t[key] for t in trials), 3),
                  "min": round(min(t[key] for t in trials), 3),
                  "max": round(max(t[key] for t in trials), 3)} for key in keys}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/prefill_gap.json"))
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="capture the CUDA graphs (decode and piecewise) as the bench does",
    )
    parser.add_argument(
        "--piecewise-max-tokens",
        type=int,
        default=EngineConfig().piecewise_max_tokens,
        help="the largest step the piecewise graphs take (with --graphs)",
    )
    parser.add_argument("--ab-pieces", action="store_true",
                        help="also run each trial eagerly, not on the piecewise graphs "
                             "(implies --graphs)")  # fmt: skip
    parser.add_argument("--ab-launch", action="store_true",
                        help="also run each trial with every launch through Triton's binding "
                             "(kernels/fast_launch.py off)")  # fmt: skip
    parser.add_argument("--ab-warm", action="store_true",
                        help="also run each paced trial right after ~200 ms of matmuls (a busy "
                             "device's clocks, not an idle one's)")  # fmt: skip
    parser.add_argument("--profile-host", type=Path, default=None,
                        help="also write cProfile's stats of one queued prefill of each length "
                             "(the host issuing it) under this folder")  # fmt: skip
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    logger.info("host CPU: %s", host_cpu())
    weights = synthetic_weights(synthetic_model_config("synthetic-120b"), device="cuda")
    # The bench's token budget; 64 seats, and the graphs (decode and piecewise) only when
    # asked: without them every prefill runs eagerly.
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64),
                          use_cuda_graphs=args.graphs or args.ab_pieces,
                          piecewise_max_tokens=args.piecewise_max_tokens)  # fmt: skip
    make_core, runner, _ = build_engine(weights, config)
    vocab = weights.config.vocab_size
    rows = []
    for length in args.lengths:
        one_prefill(make_core, vocab, length, 1, queued=False, runner=runner)  # warm
        paced, queued, lines = [], [], {}
        other_paced, other_queued = [], []
        for trial in range(args.trials):  # alternated, so drift hits both alike
            figures, lines["paced"] = one_prefill(make_core, vocab, length, 10 + trial,
                                                  queued=False, runner=runner)  # fmt: skip
            paced.append(figures)
            figures, lines["queued"] = one_prefill(make_core, vocab, length, 100 + trial,
                                                   queued=True, runner=runner)  # fmt: skip
            queued.append(figures)
            if args.ab_warm:  # paced, on a device just busy
                warmed = one_prefill(make_core, vocab, length, 10 + trial, queued=False,
                                     runner=runner, warm=True)  # fmt: skip
                other_paced.append(warmed[0])
            elif args.ab_launch or args.ab_pieces:  # the same, the other way
                pieces = runner.pieces
                if args.ab_launch:  # every launch through Triton's own binding
                    fast_launch.set_enabled(False)
                else:  # eagerly, not on the piecewise graphs
                    runner.pieces = None
                other_paced.append(one_prefill(make_core, vocab, length, 10 + trial,
                                                queued=False, runner=runner)[0])  # fmt: skip
                other_queued.append(one_prefill(make_core, vocab, length, 100 + trial,
                                                 queued=True, runner=runner)[0])  # fmt: skip
                fast_launch.set_enabled(True)
                runner.pieces = pieces
        row = {"tokens": length, "paced": summarise(paced), "queued": summarise(queued),
               "last_trial_norm_marks_ms": {k: [[round(h, 3), round(g, 3)] for h, g in v]
                                            for k, v in lines.items()}}  # fmt: skip
        if args.ab_warm:
            row["warmed"] = {"paced": summarise(other_paced)}
            med = {k: statistics.median(t[k] for t in other_paced) for k in ("wall_ms", "gpu_ms")}
            logger.info("  warmed: wall %.2f ms (%.0f tok/s), gpu %.2f", med["wall_ms"],
                        length / med["wall_ms"] * 1e3, med["gpu_ms"])  # fmt: skip
        elif args.ab_launch or args.ab_pieces:
            other = "triton_launch" if args.ab_launch else "eager"
            row[other] = {"paced": summarise(other_paced), "queued": summarise(other_queued)}
            tp, tq = (statistics.median(t["wall_ms"] for t in other_paced),
                      statistics.median(t["issue_ms"] for t in other_queued))  # fmt: skip
            logger.info("  %s: wall %.2f ms (%.0f tok/s), host issue %.2f", other, tp,
                        length / tp * 1e3, tq)  # fmt: skip
        log_timeline(lines)
        if args.profile_host is not None:
            run = functools.partial(one_prefill, make_core, vocab, length, 7, queued=True,
                                    runner=runner)  # fmt: skip
            profile_host(args.profile_host, length, run)
        med = {k: v["median"] for k, v in row["paced"].items()}
        q = {k: v["median"] for k, v in row["queued"].items()}
        logger.info(
            "prefill %5d: wall %.2f ms (%.0f tok/s) = pre %.2f + gpu %.2f + post %.2f; "
            "host issue %.2f (queued %.2f); kernels back to back %.2f",
            length, med["wall_ms"], length / med["wall_ms"] * 1e3, med["pre_ms"], med["gpu_ms"],
            med["post_ms"], med["issue_ms"], q["issue_ms"], q["gpu_ms"],
        )  # fmt: skip
        logger.info("  host ms in the ops (queued): %s",
                    {name: q[f"host_{name}_ms"] for name in TIMED_OPS})  # fmt: skip
        rows.append(row)
    write_results(args.out, host_cpu=host_cpu(), prefills=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
