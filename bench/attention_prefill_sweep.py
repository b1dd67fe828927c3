"""Prefill-attention launch-shape sweep on the GPU (H200): packed rows, keys per tile, warps and
stages of ``_attention_prefill._prefill_kernel`` for one prompt of 2048 and 8192 tokens on a
full-attention layer and a sliding-window one (120b heads: 64 query heads over 8 KV heads,
head_dim 64, pages of 16 in random order). ``--cached N``: the prompt's tokens come after N
already in the cache (an agent's next turn: prefill on top of a prefix-cache hit).

    python bench/attention_prefill_sweep.py [--tokens 2048 8192] [--cached N ...] [--full-only]
                                            [--tiles 64x64x4x2 ...]
                                            [--out bench/results/attention_prefill_sweep.json]

Each variant replaces the module's GPU_TILES and SLIDING_GPU_TILES for its run (the launcher
reads them at launch); same CUDA-graph timing as bench/kernels.py. TFLOP/s counts the visible
(token, key) pairs' QK^T and PV products, 4·D flops each per query head. Each variant's output
is compared with the default tiles' (another key order, so bf16 rounding differs: max |diff|
is reported).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import _normal
from triton.runtime.errors import OutOfResources

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _attention_prefill as prefill
from gptoss_serve.kernels.attention import paged_attention_prefill
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.attention_prefill_sweep")
# (block_m, block_n, num_warps, num_stages); the first is the default.
VARIANTS = [
    (64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4),
    (128, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
    (128, 64, 8, 1), (128, 64, 4, 2), (128, 64, 8, 3), (64, 32, 4, 2), (128, 32, 4, 2),
    (256, 64, 8, 2), (64, 64, 2, 2), (64, 32, 2, 2), (32, 32, 2, 2), (64, 16, 4, 2),
    (64, 32, 4, 3), (32, 32, 4, 2), (64, 32, 4, 1), (32, 16, 2, 2),
]  # fmt: skip


def visible_pairs(tokens: int, window: int | None, cached: int = 0) -> int:
    """(query, key) pairs a causal prompt of ``tokens`` sees after ``cached`` keys."""
    if window is None:
        return tokens * cached + tokens * (tokens + 1) // 2
    return sum(min(cached + t + 1, window) for t in range(tokens))


def _calls(queries: list, inputs: tuple, window: int | None, scale: float) -> list:
    return [paged_attention_prefill(q, *inputs, window=window, scale=scale) for q in queries]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/attention_prefill_sweep.json"))
    parser.add_argument("--tokens", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument(
        "--cached",
        type=int,
        nargs="*",
        default=[0],
        help="keys in the cache before them (each with each --tokens)",
    )
    parser.add_argument("--full-only", action="store_true", help="skip the sliding layer")
    parser.add_argument(
        "--tiles",
        nargs="*",
        default=None,
        metavar="MxNxWARPSxSTAGES",
        help="these variants only (e.g. 64x64x4x2), the first the reference",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    a, kv, d, page = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 16
    defaults = prefill.GPU_TILES, prefill.SLIDING_GPU_TILES
    variants = VARIANTS
    if args.tiles:
        variants = [tuple(int(n) for n in tiles.split("x")) for tiles in args.tiles]
    rows = []
    for cached, tokens in itertools.product(args.cached, args.tokens):
        seq_len = cached + tokens
        blocks = -(-seq_len // page)
        shape = (blocks, page, kv, d)
        k_cache, v_cache = _normal(shape, 1.0, "cuda"), _normal(shape, 1.0, "cuda")
        tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, -1)
        starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
        sinks = _normal((a,), 1.5, "cuda")
        queries = [_normal((tokens, a, d), 1.0, "cuda") for _ in range(4)]
        inputs = (k_cache, v_cache, tables, starts, seq_lens, sinks)
        for window in (None,) if args.full_only else (None, config.sliding_window):
            flops = 4 * d * a * visible_pairs(tokens, window, cached)
            reference = None
            for variant in variants:
                prefill.GPU_TILES = prefill.SLIDING_GPU_TILES = prefill.PrefillTiles(*variant)
                try:
                    run = functools.partial(_calls, queries, inputs, window, d**-0.5)
                    out = run()[0]
                    times = graph_time_ms(run, calls=len(queries), repeats=10)
                except OutOfResources as error:  # a variant that does not fit: report it
                    logger.info("%s: %s", variant, str(error).splitlines()[0][:120])
                    rows.append({"tokens": tokens, "window": window, "tiles": variant,
                                 "error": str(error).splitlines()[0][:200]})  # fmt: skip
                    continue
                finally:
                    prefill.GPU_TILES, prefill.SLIDING_GPU_TILES = defaults
                reference = out if reference is None else reference
                diff = (out.float() - reference.float()).abs().max().item()
                us = statistics.median(times) * 1e3
                tflops = flops / (us * 1e-6) / 1e12
                logger.info("T %5d cached %6d window %-4s tiles %-18s %9.1f us %7.1f TFLOP/s"
                            "  diff %.2e", tokens, cached, window, variant, us, tflops,
                            diff)  # fmt: skip
                rows.append({"tokens": tokens, "cached": cached, "window": window,
                             "tiles": variant,
                             "us": round(us, 1), "tflops": round(tflops, 1),
                             "max_abs_diff": diff})  # fmt: skip
    write_results(args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
