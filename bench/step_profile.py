"""Where the 120b decode step's time goes (H200): each stage timed alone, 36 layers' worth of
calls captured in one CUDA graph, next to the whole step; plus the dense GEMV's tile sweep.

    python bench/step_profile.py [--out bench/results/step_profile.json] [--batch 1]

The stages use the step's own weights and buffers (bench/gpu_model.py), so each call reads
fresh weights from HBM as in the real step. "sum of stages" vs "whole step" is what the
kernel boundaries cost (or save, where neighbours overlap).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import DecodeStep

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels._sampling import sample_tokens_triton
from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.linear import GemvTiles, linear, linear_reference
from gptoss_serve.kernels.moe import mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.rope import rope_and_cache_write
from gptoss_serve.kernels.sampling import sample_tokens
from kernels import FLOOR_DECODE_STEP_MS, commit, copy_tbps, graph_time_ms

logger = logging.getLogger("bench.step_profile")
GEMV_SWEEP = [GemvTiles(r, w) for r, w in [(1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]]


def stages(step: DecodeStep, pdl: bool = False) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (a callable running the stage for every layer, bytes of weights/KV it reads);
    ``pdl``: the Triton kernels as programmatic dependent launches (kernels/launch.py)."""
    config, batch = step.config, step.hidden.shape[0]
    a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = step.hidden
    q = torch.randn(batch, a, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv, d, device="cuda", dtype=torch.bfloat16)
    attn_out = torch.randn(batch, config.q_dim, device="cuda", dtype=torch.bfloat16)
    attns = [layer.attention for layer in step.weights.layers]
    moes = [layer.moe for layer in step.weights.layers]

    def dense(fn: Callable, name: str) -> tuple[Callable[[], object], int]:
        inputs = {"qkv": x, "o": attn_out}
        weights = {
            "qkv": [(w.qkv_weight, w.qkv_bias) for w in attns],
            "o": [(w.o_weight, w.o_bias) for w in attns],
        }[name]
        nbytes = sum(w.numel() * 2 for w, _ in weights)
        return (lambda: [fn(inputs[name], w, b) for w, b in weights]), nbytes

    def attention() -> list:
        outs = []
        for index, (k_cache, v_cache) in enumerate(step.caches):
            window = config.sliding_window if config.is_sliding(index) else None
            outs.append(
                paged_attention_decode(
                    q,
                    k_cache,
                    v_cache,
                    step.block_tables,
                    step.seq_lens,
                    attns[index].sinks,
                    window=window,
                    scale=d**-0.5,
                    pdl=pdl,
                )
            )
        return outs

    lm_head = step.weights.lm_head
    lm_bytes = lm_head.numel() * 2
    logits = torch.randn(batch, config.vocab_size, device="cuda") * 3
    result = {
        "norms (2 per layer)": (
            lambda: [
                fused_add_rms_norm(x, x, w.input_norm, 1e-5, pdl=pdl)
                for w in attns
                for _ in range(2)
            ],
            0,
        ),
        "qkv cublas": dense(linear_reference, "qkv"),
        "qkv triton": dense(functools.partial(linear, pdl=pdl), "qkv"),
        "rope + cache write": (
            lambda: [
                rope_and_cache_write(
                    q,
                    k,
                    k,
                    step.positions,
                    step.weights.inv_freq,
                    config.rope.attention_scaling,
                    kc,
                    vc,
                    step.slot_mapping,
                    pdl=pdl,
                )
                for kc, vc in step.caches
            ],
            0,
        ),
        "attention": (attention, 0),
        "o cublas": dense(linear_reference, "o"),
        "o triton": dense(functools.partial(linear, pdl=pdl), "o"),
        "moe": (lambda: [mxfp4_moe(x, moe, pdl=pdl) for moe in moes], 0),
        "unembed cublas": (
            lambda: linear_reference(x, lm_head, out_dtype=torch.float32),
            lm_bytes,
        ),
        "unembed triton": (lambda: linear(x, lm_head, out_dtype=torch.float32), lm_bytes),
        "sampling bf16 logits": (
            lambda: sample_tokens(
                logits.to(torch.bfloat16), step.temperature, step.top_p, step.seeds, step.steps
            ),
            0,
        ),
        "sampling fp32 logits, chunk 1024": (
            lambda: sample_tokens_triton(
                logits, step.temperature, step.top_p, step.seeds, step.steps, chunk=1024
            ),
            0,
        ),
        "sampling fp32 logits, chunk 16384": (
            lambda: sample_tokens_triton(
                logits, step.temperature, step.top_p, step.seeds, step.steps, chunk=16384
            ),
            0,
        ),
        "sampling fp32 logits": (
            lambda: sample_tokens(logits, step.temperature, step.top_p, step.seeds, step.steps),
            0,
        ),
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results/step_profile.json"
    )
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    copy = copy_tbps()
    step = DecodeStep(config, batch=args.batch, context=1024)
    rows = []
    for name, (fn, nbytes) in stages(step).items():
        us = statistics.median(graph_time_ms(fn, repeats=20)) * 1e3
        rows.append(
            {
                "stage": name,
                "us": round(us, 1),
                "tbps": round(nbytes / (us * 1e-6) / 1e12, 3) if nbytes else None,
            }
        )
    attns = [layer.attention for layer in step.weights.layers]
    for tiles in GEMV_SWEEP:
        for name, weight_of, x in [
            ("qkv", lambda w: w.qkv_weight, step.hidden),
            (
                "o",
                lambda w: w.o_weight,
                torch.randn(args.batch, config.q_dim, device="cuda", dtype=torch.bfloat16),
            ),
        ]:
            weights = [weight_of(w) for w in attns]
            us = (
                statistics.median(
                    graph_time_ms(
                        lambda weights=weights, x=x, tiles=tiles: [
                            linear(x, w, tiles=tiles) for w in weights
                        ],
                        repeats=20,
                    )
                )
                * 1e3
            )
            nbytes = sum(w.numel() * 2 for w in weights)
            rows.append(
                {
                    "stage": f"sweep {name} rows={tiles.rows} warps={tiles.num_warps}",
                    "us": round(us, 1),
                    "tbps": round(nbytes / (us * 1e-6) / 1e12, 3),
                }
            )
    for dense in ("cublas", "triton-unfused", "triton"):
        step.dense = linear_reference if dense == "cublas" else linear
        step.fused_qkv = dense == "triton"  # q/k/v GEMV with RoPE and the cache write
        ms = statistics.median(graph_time_ms(step, repeats=30))
        rows.append(
            {"stage": f"whole step ({dense} projections)", "us": round(ms * 1e3, 1), "tbps": None}
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "commit": commit(),
        "batch": args.batch,
        "copy_tbps": round(copy, 3),
        "floor_ms": FLOOR_DECODE_STEP_MS,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(f"\n{result['device']}  batch {args.batch}  copy {copy:.2f} TB/s\n")
    sys.stdout.write(f"{'stage (all 36 layers)':44} {'us':>9} {'TB/s':>7}\n")
    for row in rows:
        tbps = f"{row['tbps']:7.2f}" if row["tbps"] else ""
        sys.stdout.write(f"{row['stage']:44} {row['us']:9.1f} {tbps}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
