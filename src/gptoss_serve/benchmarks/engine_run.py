"""The `gptoss-serve bench` run: build the engine once, run every scenario of engine_bench.py,
print the table and write bench/results/engine.json; the 128k-in-80-GB check runs in a
second process, whose allocator is capped before any weight is made.
"""

from __future__ import annotations

import datetime
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.benchmarks.power import PowerMeter, power_meter
from gptoss_serve.config import EngineConfig, SamplingParams
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.kv_sizing import KvCachePlan
from gptoss_serve.engine.startup import build_engine, settled_config, step_forward_bytes
from gptoss_serve.engine.weights import ModelWeights
from gptoss_serve.gc_heap import frozen_startup_heap
from gptoss_serve.kernels.kv_dtype import cache_dtype

logger = logging.getLogger(__name__)

FIT_CAP_GB = 80.0
FIT_CONTEXT = 128 * 1024  # tokens of context the capped process must serve
FIT_OUTPUT_TOKENS = 16
T = TypeVar("T")
DECODE_BATCHES = (8, 32, 64)  # the concurrent decode figures
THROUGHPUT_LENGTH = 1024  # prompt and output tokens of each max-throughput sequence


def run_engine_bench(
    weights: ModelWeights, name: str, config: EngineConfig, *, decode_tokens: int,
    throughput_seqs: int, commit: str | None,
) -> dict:  # fmt: skip
    started = time.perf_counter()
    # The seats settled as `serve --max-num-seqs auto` settles them (engine/seats.py): as many
    # as hold 2k tokens each, up to the request, never below the largest decode batch here.
    # The forward pass profiled once for both.
    forward_bytes = step_forward_bytes(weights, config)
    config = settled_config(weights, replace(config, fit_max_num_seqs=True),
                            forward_bytes=forward_bytes)  # fmt: skip
    make_core, _, plan = build_engine(weights, config, forward_bytes=forward_bytes)
    logger.warning("engine ready in %.1fs: %d KV tokens", time.perf_counter() - started,
                   plan.max_num_tokens)  # fmt: skip
    # As the server runs (server/app.py): the start-up heap out of the garbage collector, so
    # a full collection (~150 ms holding the GIL) walks only what the requests made.
    device = torch.cuda.get_device_name(weights.device) if weights.device.type == "cuda" else "cpu"
    with frozen_startup_heap():
        figures = _figures(
            make_core, weights, config, plan, device=device, decode_tokens=decode_tokens,
            throughput_seqs=throughput_seqs,
        )  # fmt: skip
    return {
        "device": device, "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": name, "kv_cache_tokens": plan.max_num_tokens,
        "settings": {"max_num_seqs": config.scheduler.max_num_seqs,
                     "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                     "decode_tokens": decode_tokens, "cuda_graphs": config.use_cuda_graphs,
                     "piecewise_max_tokens": config.piecewise_max_tokens,
                     "programmatic_launch": config.programmatic_launch,
                     "async_scheduling": config.async_scheduling,
                     "kv_cache_dtype": config.kv_cache_dtype},
        "figures": figures,
    }  # fmt: skip


def _figures(
    make_core: Callable[[], EngineCore], weights: ModelWeights, config: EngineConfig,
    plan: KvCachePlan, *, device: str, decode_tokens: int, throughput_seqs: int,
) -> list[eb.Figure]:  # fmt: skip
    """Every scenario of engine_bench.py on the built engine, in the table's order, with
    the ceilings of ``device`` (its name)."""
    model = weights.config
    rates = eb.device_rates(device)
    kv_bytes = cache_dtype(config.kv_cache_dtype, weights.dtype).itemsize
    figures = []

    def metered(measure: Callable[[PowerMeter | None], T]) -> tuple[T, dict | None]:
        """``measure``'s result, with it given a fresh meter of the board (None without
        NVML), and the meter's reading."""
        meter = power_meter(weights.device)
        value = measure(meter)
        return value, meter.reading() if meter else None

    def decode(figure: str, batch: int, context: int) -> None:
        value, power = metered(lambda meter: eb.decode_tok_s(
            make_core, model, batch=batch, context=context, num_tokens=decode_tokens,
            meter=meter))  # fmt: skip
        ceiling = eb.decode_ceiling_tok_s(model, batch, context + decode_tokens // 2, rates,
                                          kv_element_bytes=kv_bytes)  # fmt: skip
        figures.append(eb.Figure(figure, value, ceiling, "tok/s", power))
        logger.warning("%s: %.1f tok/s", figure, value)

    # An untimed short decode first: whatever the engine still does once (first replays of
    # the graphs, allocator growth) lands here and not in the first figure (e10: bs1 1k once
    # came out below bs1 8k, right after start-up).
    eb.decode_tok_s(make_core, model, batch=1, context=1024, num_tokens=16)
    decode("decode_bs1_ctx1k_tok_s", 1, 1024)
    decode("decode_bs1_ctx8k_tok_s", 1, 8192)
    for batch in DECODE_BATCHES:
        decode(f"decode_conc{batch}_tok_s", batch, 1024)
    prefill_ceiling = eb.prefill_ceiling_tok_s(model, rates)
    for length in (2048, 8192):
        runs, power = metered(lambda meter, n=length: eb.prefill_rates(make_core, model, n, meter))
        figures.append(eb.Figure(f"prefill_{length}_tok_s", statistics.median(runs),
                                 prefill_ceiling, "tok/s", power,
                                 tuple(round(run, 1) for run in runs)))  # fmt: skip
    runs, power = metered(lambda meter: eb.prefill_rates(make_core, model, 1024, meter))
    ttfts = [1e3 * 1024 / rate for rate in runs]
    figures.append(eb.Figure("ttft_1k_ms", statistics.median(ttfts), None, "ms", power,
                             tuple(round(ttft, 2) for ttft in ttfts)))  # fmt: skip
    # As many sequences as fit (each holds 2k tokens at its end), up to ``throughput_seqs``.
    seqs = min(throughput_seqs, config.scheduler.max_num_seqs,
               plan.max_num_tokens // (2 * THROUGHPUT_LENGTH))  # fmt: skip
    value, power = metered(lambda meter: eb.max_throughput_tok_s(
        make_core, model, num_seqs=seqs, length=THROUGHPUT_LENGTH, meter=meter))  # fmt: skip
    ceiling = eb.decode_ceiling_tok_s(model, seqs, 1536, rates, kv_element_bytes=kv_bytes)
    figures.append(eb.Figure("max_throughput_tok_s", value, ceiling, f"tok/s ({seqs} seqs)",
                             power))  # fmt: skip
    figures.append(eb.Figure("peak_gpu_memory_gb", eb.peak_memory_gb(weights.device), None, "GB"))
    return figures


def run_fit_check(weights: ModelWeights, config: EngineConfig) -> int:
    """In the capped process (``cap_process_memory`` already called): serve one request of
    FIT_CONTEXT tokens of context; prints one JSON line for the parent."""
    scheduler = replace(config.scheduler, max_num_seqs=4, max_model_len=FIT_CONTEXT)
    config = replace(config, scheduler=scheduler, max_gpu_memory_gb=FIT_CAP_GB,
                     fit_max_num_seqs=False)  # fmt: skip
    make_core, _, plan = build_engine(weights, config)
    core = make_core()
    prompt_len = FIT_CONTEXT - FIT_OUTPUT_TOKENS
    prompt = [(i * 7919) % 200_000 for i in range(prompt_len)]
    core.add_request("fit", prompt, SamplingParams(max_tokens=FIT_OUTPUT_TOKENS, seed=0))
    started, num_tokens = time.perf_counter(), 0
    while core.has_unfinished_requests:
        result = core.step()
        if result.failed:
            raise RuntimeError(f"the fit check failed: {result.failed}")
        num_tokens += sum(len(o.new_token_ids) for o in result.outputs)
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_reserved(weights.device) / 1e9
    served = num_tokens == FIT_OUTPUT_TOKENS and peak <= FIT_CAP_GB
    print(json.dumps({"fits_80gb_with_128k_context": served, "context_tokens": FIT_CONTEXT,  # noqa: T201
                      "peak_reserved_gb": round(peak, 2), "kv_cache_tokens": plan.max_num_tokens,
                      "seconds": round(elapsed, 1), "output_tokens": num_tokens}))  # fmt: skip
    return 0


def cap_process_memory(device: int = 0) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, FIT_CAP_GB * 1e9 / total), device)


def fit_check_subprocess(model: str, kv_cache_dtype: str = "auto") -> dict:
    command = [sys.executable, "-m", "gptoss_serve.cli", "bench", "--model", model,
               "--kv-cache-dtype", kv_cache_dtype, "--fit-check-only"]  # fmt: skip
    logger.warning("fit check: %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        logger.error("fit check failed (exit %d): %s", done.returncode, done.stderr[-2000:])
        return {"fits_80gb_with_128k_context": False, "error": done.stderr[-500:]}
    return json.loads(lines[-1])


def write_results(results: dict, fit: dict | None, out: Path) -> None:
    figures = results.pop("figures")
    table = eb.format_table(figures)
    results.update({figure.name: round(figure.value, 2) for figure in figures})
    results["ceilings"] = {f.name: round(f.ceiling, 1) for f in figures if f.ceiling}
    results["power"] = {f.name: f.power for f in figures if f.power}
    results["trials"] = {f.name: list(f.trials) for f in figures if f.trials}
    if fit is not None:
        results["fits_80gb_with_128k_context"] = fit.get("fits_80gb_with_128k_context", False)
        results["fit_check"] = fit
        table += f"\nfits_80gb_with_128k_context: {results['fits_80gb_with_128k_context']} {fit}"
    print(table)  # noqa: T201 (the command's output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
