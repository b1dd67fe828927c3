"""Kernel roofline benchmark on the GPU (H200): prints one table, writes results/kernels.json.

    python bench/kernels.py [--out bench/results/kernels.json] [--quick]

Every figure is timed on random data, after warm-up, as the median of CUDA-graph replays (so
launch gaps count as they will in the engine's captured decode step), against ceilings
measured in the same run: the device-to-device copy rate and the bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import DecodeStep, _normal, random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.attention import kv_bytes_read, paged_attention_decode
from gptoss_serve.kernels.moe import (
    mxfp4_moe,
    mxfp4_moe_bytes,
    mxfp4_moe_flops,
    route,
    router_logits_reference,
)

logger = logging.getLogger("bench.kernels")
FLOOR_DECODE_STEP_MS = 1.16  # 5.0 GB per token at 4.3 TB/s (docs/performance.md)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` warmed up (compile, autotune, allocate) on a side stream, then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time_ms(fn: Callable[[], object], *, calls: int = 1, repeats: int = 20) -> list[float]:
    """Capture ``fn`` (which may itself make several calls) in a CUDA graph; per-replay ms."""
    graph = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def copy_tbps() -> float:
    # 4 GiB of float32 through an SM kernel (a plain copy_ becomes a copy-engine memcpy,
    # which tops out near 2.8 TB/s); bytes read plus bytes written.
    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    times = graph_time_ms(lambda: torch.mul(src, 1.0, out=dst))
    return 2 * src.numel() * src.element_size() / (statistics.median(times) * 1e-3) / 1e12


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = graph_time_ms(lambda: a @ b)
    return 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def bench_moe(config: ModelConfig, results: dict, rows: list, ceilings: dict) -> None:
    weights = random_moe_weights(config)
    calls = 36  # 36 layers' worth of calls, each on its own input so experts change
    for tokens in (1, 8, 32, 64):
        inputs = [_normal((tokens, config.hidden_size), 1.0, "cuda") for _ in range(calls)]
        times = graph_time_ms(lambda inputs=inputs: [mxfp4_moe(x, weights) for x in inputs],
                              calls=calls)  # fmt: skip
        nbytes = statistics.mean(
            mxfp4_moe_bytes(tokens, weights, route(router_logits_reference(x, weights), 4)[1])
            for x in inputs
        )
        tbps = nbytes / (statistics.median(times) * 1e-3) / 1e12
        key = "moe_decode_bs1_effective_tbps" if tokens == 1 else f"moe_decode_{tokens}_tbps"
        results[key] = round(tbps, 3)
        results[f"moe_decode_{tokens}_us"] = round(statistics.median(times) * 1e3, 2)
        rows.append((f"MoE decode, {tokens} tok (per layer)", tbps, "TB/s", ceilings["copy"]))
    # 60 replays (80-300 ms): the clock steps between plateaus within a run (RESULTS v11:
    # 1,345 -> 1,590 us a call at 2048 tokens over 60 replays), so 10 replays caught one
    # plateau (225 to 305 TFLOP/s between runs of the same kernels).
    for tokens in (2048, 8192):
        x = _normal((tokens, config.hidden_size), 1.0, "cuda")
        times = graph_time_ms(lambda x=x: mxfp4_moe(x, weights), repeats=60)
        flops = mxfp4_moe_flops(tokens, weights, top_k=config.num_experts_per_tok)
        tflops = flops / (statistics.median(times) * 1e-3) / 1e12
        results[f"moe_prefill_{tokens}_tflops"] = round(tflops, 1)
        results[f"moe_prefill_{tokens}_tflops_spread"] = [
            round(flops / (t * 1e-3) / 1e12, 1) for t in (max(times), min(times))
        ]
        rows.append((f"MoE prefill, {tokens} tok", tflops, "TFLOP/s", ceilings["matmul"]))


def attention_decode_tbps(
    config: ModelConfig, batch: int, context: int, *, pdl: bool = False
) -> float:
    """Paged decode attention of ``batch`` sequences of ``context`` keys (random cache, pages in
    random order, 8 calls per replay): KV bytes read / median time, in TB/s. ``pdl``: launched
    as programmatic dependent launches, as the engine launches them (each call's split-merge
    kernel then waits beside the attention kernel instead of after a launch gap)."""
    a, kv, d, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 16
    blocks_per_seq = -(-context // block)
    shape = (batch * blocks_per_seq, block, kv, d)
    k_cache, v_cache = _normal(shape, 1.0, "cuda"), _normal(shape, 1.0, "cuda")
    tables = torch.randperm(shape[0], device="cuda").to(torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    sinks = _normal((a,), 1.5, "cuda")
    queries = [_normal((batch, a, d), 1.0, "cuda") for _ in range(8)]
    times = graph_time_ms(
        lambda: [
            paged_attention_decode(
                q, k_cache, v_cache, tables, seq_lens, sinks, window=None, scale=d**-0.5, pdl=pdl
            )
            for q in queries
        ],
        calls=len(queries),
    )
    return kv_bytes_read(seq_lens, None, kv, d) / (statistics.median(times) * 1e-3) / 1e12


def bench_attention(config: ModelConfig, results: dict, rows: list, ceilings: dict,
                    contexts: tuple[int, ...]) -> None:  # fmt: skip
    for pdl in (False, True):  # plain launches; as the engine launches them
        suffix = "_pdl" if pdl else ""
        for batch in (1, 32):
            for context in contexts:
                tbps = attention_decode_tbps(config, batch, context, pdl=pdl)
                label = f"{context // 1024}k" if context >= 1024 else str(context)
                results[f"attn_decode_bs{batch}_{label}{suffix}_tbps"] = round(tbps, 3)
                name = f"decode attention bs{batch}, {label}{', PDL' if pdl else ''}"
                rows.append((name, tbps, "TB/s", ceilings["copy"]))


def bench_decode_step(config: ModelConfig, results: dict, rows: list) -> None:
    step = DecodeStep(config, batch=1, context=1024, pdl=True)  # as the engine launches it
    times = graph_time_ms(step, repeats=30)
    ms = statistics.median(times)
    results["decode_step_bs1_ctx1k_ms"] = round(ms, 3)
    results["decode_step_bs1_ctx1k_spread_ms"] = [round(min(times), 3), round(max(times), 3)]
    rows.append(("whole 120b decode step, bs1, 1k", ms, "ms", FLOOR_DECODE_STEP_MS))


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: Path, **fields: object) -> None:
    """A bench script's JSON at ``path``: device, commit and date, then ``fields``."""
    result = {"device": torch.cuda.get_device_name(), "commit": commit(),
              "date": dt.date.today().isoformat(), **fields}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/kernels.json")
    parser.add_argument("--quick", action="store_true", help="skip the 128k and whole-step runs")
    parser.add_argument("--only", choices=("moe", "attention", "step"), default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh data every run
    config = ModelConfig.from_dict(preset_config("120b"))
    ceilings = {"copy": copy_tbps(), "matmul": matmul_tflops()}
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "copy_tbps": round(ceilings["copy"], 3),
        "bf16_matmul_tflops": round(ceilings["matmul"], 1),
    }
    rows: list[tuple[str, float, str, float]] = []
    contexts = (1024, 8192, 32768) if args.quick else (1024, 8192, 32768, 131072)
    steps = {
        "moe": lambda: bench_moe(config, results, rows, ceilings),
        "attention": lambda: bench_attention(config, results, rows, ceilings, contexts),
        "step": lambda: bench_decode_step(config, results, rows),
    }
    for name, run in steps.items():
        if args.only not in (None, name) or (args.quick and name == "step"):
            continue
        logger.info("benchmarking %s", name)
        run()
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    sys.stdout.write(f"\n{results['device']}  commit {results['commit'][:10]}  {results['date']}\n")
    sys.stdout.write(f"{'figure':40} {'value':>10} {'unit':8} {'ceiling':>9} {'%':>6}\n")
    for figure, value, unit, ceiling in rows:
        percent = 100 * (ceiling / value if unit == "ms" else value / ceiling)
        sys.stdout.write(f"{figure:40} {value:10.3f} {unit:8} {ceiling:9.2f} {percent:5.0f}%\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
