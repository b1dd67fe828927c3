"""What each op costs the whole 120b decode step (PDL, CUDA graph: as bench/kernels.py times it):
the step with that op's launches left out, between two runs of the whole step. Under PDL the
kernels' times do not add up (a kernel launched early waits in ``griddepcontrol.wait``), so the
step without an op is the most that fusing it into its neighbours could save. Timing only: the
skipped op's output is its input (or a fixed buffer), so the logits are not the model's. Nor
is the routing: past a few tokens the MoE's cost follows how many distinct experts the batch
routes to, so leaving out an op before it moves the MoE too (at batch 64 the step without its
norms saves 9.4 ms, mostly MoE; without q/k/v or o it ran slower: bench/RESULTS.md v30). Up to 4
tokens (the per-pair path, which reads each pair's rows whichever expert it picks) the rows
hold; past that read only the MoE's.

    cd bench && python3 step_skip.py [--batch 1 64] [--skip norm attention moe qkv o]
                                     [--out results/step_skip.json]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import gpu_model
import torch
from gpu_model import DecodeStep

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.step_skip")


def _norm_skipped(x, residual, weight, eps, *, pdl=False):
    return x, x if residual is None else residual


def _patches(step: DecodeStep, name: str) -> list[tuple[object, str, Callable]]:
    """(owner, attribute, stand-in) for the op ``name``."""
    if name == "norm":
        return [(gpu_model, "fused_add_rms_norm", _norm_skipped)]
    if name == "attention":
        return [(gpu_model, "paged_attention_decode", lambda q, *a, **k: q)]
    if name == "moe":
        return [(gpu_model, "mxfp4_moe", lambda x, *a, **k: x)]
    if name == "qkv":
        config = step.config
        q = torch.zeros(
            step.hidden.shape[0], config.num_attention_heads, config.head_dim,
            dtype=torch.bfloat16, device="cuda",
        )  # fmt: skip
        return [(step, "_qkv_rope", lambda *a, **k: q)]
    if name == "o":  # the o projection only: the unembedding keeps its GEMV
        dense = step.dense
        o = torch.zeros_like(step.hidden)

        def o_skipped(x, weight, bias=None, **kwargs):
            return (
                o
                if weight.shape[0] == step.config.hidden_size
                else dense(x, weight, bias, **kwargs)
            )

        return [(step, "dense", o_skipped)]
    raise ValueError(f"unknown op {name!r}")


@contextmanager
def skipped(step: DecodeStep, name: str):
    patches = _patches(step, name)
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, stand_in in patches:
        setattr(owner, attr, stand_in)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--skip", nargs="+", default=["norm", "attention", "moe", "qkv", "o"])
    parser.add_argument("--out", type=Path, default=Path("results/step_skip.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    weights, rows = None, []
    for batch in args.batch:
        step = DecodeStep(config, batch=batch, context=args.context, pdl=True, weights=weights)
        weights = step.weights
        whole = [statistics.median(graph_time_ms(step, repeats=30))]
        for name in args.skip:
            with skipped(step, name):
                ms = statistics.median(graph_time_ms(step, repeats=30))
            whole.append(statistics.median(graph_time_ms(step, repeats=30)))
            row = {"batch": batch, "skipped": name, "ms": round(ms, 4),
                   "whole_ms": [round(whole[-2], 4), round(whole[-1], 4)]}  # fmt: skip
            logger.info("%s", row)
            rows.append(row)
    write_results(args.out, context=args.context, rows=rows)
    sys.stdout.write(f"\nwhole step without one op, context {args.context} (ms)\n")
    sys.stdout.write(f"{'batch':>5} {'skipped':>10} {'ms':>9} {'whole before/after':>20} saved\n")
    for row in rows:
        before, after = row["whole_ms"]
        saved = (before + after) / 2 - row["ms"]
        sys.stdout.write(
            f"{row['batch']:5d} {row['skipped']:>10} {row['ms']:9.4f} {before:9.4f} "
            f"{after:9.4f}  {saved:7.4f}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
