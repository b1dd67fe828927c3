"""The served workload without HTTP (GPU machine): many requests in flight, each with or without
the grammar every API request carries (its reasoning budget), on the engine `serve` builds.

    cd bench && python3 grammar_load.py [--kv-cache-dtype fp8] [--concurrency 160]
        [--requests 320] [--variants none grammar [none-frozen grammar-frozen] [grammar ...]]
        [--out results/grammar_load.json]

Keeps ``--concurrency`` requests running (1000-token prompts, 256 output tokens, temperature 1,
a new request as each one ends, as `gptoss-serve bench-serve` does over HTTP) and prints per
variant the output tok/s, the step's mean and median wall time, and the host's milliseconds
a step in the engine core's phases (schedule, the forward pass's preparation and launch, the
grammars' masks and advance, reading the tokens back: what the device did not hide). Where
"grammar" is much slower than "none", the masks sit on the step's critical path
(bench/RESULTS.md e25). A "-frozen" variant runs with the start-up heap frozen out of the
garbage collector, as the server does (bench/RESULTS.md s6); a variant may be named again
(alternating A/B runs), each run kept under its own key.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gptoss_serve.benchmarks import report
from gptoss_serve.config import EngineConfig, SamplingParams, SchedulerConfig
from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar
from gptoss_serve.engine import seats
from gptoss_serve.engine.allocator import configure_allocator
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from gptoss_serve.gc_heap import frozen_startup_heap
from gptoss_serve.harmony import adapter

PROMPT_TOKENS, OUTPUT_TOKENS = 1000, 256
REASONING_BUDGET = OUTPUT_TOKENS // 2  # the server's budget at this max_output_tokens


def _timed(owner: object, name: str, totals: dict[str, float], key: str) -> Callable[[], None]:
    """Wrap ``owner.name`` to add its wall time to ``totals[key]``; returns the undo."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - started

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def run_variant(core: EngineCore, *, grammar: str | None, concurrency: int, total: int) -> dict:
    totals: dict[str, float] = {}
    undo = [
        _timed(core.scheduler, "schedule", totals, "schedule"),
        _timed(core.runner, "forward", totals, "forward"),
        _timed(core._grammars, "bitmask", totals, "masks"),
        _timed(core._grammars, "advance", totals, "advance"),
        _timed(core, "_complete", totals, "read back + update"),
    ]
    collections: list[float] = []  # the oldest generation's passes, their wall times
    pass_started = 0.0

    def on_gc(phase: str, info: dict) -> None:
        nonlocal pass_started
        if info["generation"] != 2:
            return
        if phase == "start":
            pass_started = time.perf_counter()
        else:
            collections.append(time.perf_counter() - pass_started)

    gc.callbacks.append(on_gc)
    undo.append(lambda: gc.callbacks.remove(on_gc))
    stops = adapter.assistant_stop_token_ids() if grammar else ()
    added = 0

    def add() -> None:
        nonlocal added
        generator = torch.Generator().manual_seed(added)
        prompt = torch.randint(0, 199_000, (PROMPT_TOKENS,), generator=generator).tolist()
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, seed=added,
                                stop_token_ids=stops, grammar=grammar)  # fmt: skip
        core.add_request(f"r{added}", prompt, params)
        added += 1

    for _ in range(min(concurrency, total)):
        add()
    num_tokens, steps = 0, []
    started = time.perf_counter()
    try:
        while core.has_unfinished_requests:
            step_started = time.perf_counter()
            result = core.step()
            steps.append(time.perf_counter() - step_started)
            if result.failed:
                raise RuntimeError(f"requests failed: {result.failed}")
            for output in result.outputs:
                num_tokens += len(output.new_token_ids)
                if output.finish_reason is not None and added < total:
                    add()
    finally:
        for restore in undo:
            restore()
    wall = time.perf_counter() - started
    return {
        "out_tok_s": round(num_tokens / wall, 1),
        "steps": len(steps),
        "step_ms_mean": round(1e3 * wall / len(steps), 2),
        "step_ms_p50": round(1e3 * statistics.median(steps), 2),
        "step_ms_p99": round(1e3 * statistics.quantiles(steps, n=100)[98], 2),
        "step_ms_max": round(1e3 * max(steps), 2),
        "steps_over_60ms": sum(step > 0.06 for step in steps),
        "full_collections": len(collections),
        "full_collections_ms": round(1e3 * sum(collections), 1),
        "host_ms_per_step": {k: round(1e3 * v / len(steps), 2) for k, v in totals.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synthetic-120b")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("auto", "fp8"))
    parser.add_argument("--concurrency", type=int, default=160)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--variants", nargs="+", default=["none", "grammar"],
                        choices=("none", "grammar", "none-frozen", "grammar-frozen"))  # fmt: skip
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results/grammar_load.json")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)  # the engine's sizing: seats, KV cache, graphs
    configure_allocator()  # as `serve` runs (cli.main)
    weights = synthetic_weights(synthetic_model_config(args.model), device="cuda")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=seats.MAX_SEATS),
                          kv_cache_dtype=args.kv_cache_dtype, fit_max_num_seqs=True)  # fmt: skip
    make_core, runner, _ = build_engine(weights, config)
    grammar = build_grammar(ConstraintSpec(reasoning_budget=REASONING_BUDGET))
    rows = {}
    for number, variant in enumerate(args.variants):
        kind, _, frozen = variant.partition("-")
        # a variant named again (alternating A/B runs) is kept under its own key
        key = variant if variant not in rows else f"{variant}#{number}"
        core = make_core()
        # "-frozen": the start-up heap frozen out of the collector, as the server's lifespan
        # does (gc_heap.py), for this variant only
        heap = frozen_startup_heap() if frozen else contextlib.nullcontext()
        try:
            with heap:
                rows[key] = run_variant(
                    core, grammar=grammar if kind == "grammar" else None,
                    concurrency=args.concurrency, total=args.requests,
                )  # fmt: skip
        finally:
            core.close()
        print(key, json.dumps(rows[key]), flush=True)  # noqa: T201
    results = {
        "device": torch.cuda.get_device_name(), "commit": report.git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
        "seats": runner.batch.max_num_seqs, "concurrency": args.concurrency,
        "requests": args.requests, "variants": rows,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
        "device_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 2),
    }  # fmt: skip
    print("peak reserved", results["peak_reserved_gb"], "GB of", results["device_gb"], flush=True)  # noqa: T201
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
