"""The 120b decode step with and without programmatic dependent launch (H200).

    python bench/pdl_step.py [--batch 1 8 64] [--out bench/results/pdl_step.json]

For each batch size: the whole step (36 layers, CUDA graph, 1k context) with plain launches
and with PDL (kernels/launch.py), whose logits must be bit for bit the same (same kernels,
same order of arithmetic); then each stage alone, 36 calls in one graph, both ways.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import DecodeStep
from step_profile import stages

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from kernels import capture_graph, commit, graph_time_ms

logger = logging.getLogger("bench.pdl_step")


def us(fn: Callable[[], object], repeats: int = 30) -> float:
    return statistics.median(graph_time_ms(fn, repeats=repeats)) * 1e3


def graph_logits(step: DecodeStep) -> torch.Tensor:
    """The step's logits from a CUDA-graph replay (as the engine runs it)."""
    capture_graph(step).replay()
    torch.cuda.synchronize()
    return step.last_logits.clone()


STAGES = {"norms (2 per layer)": "norms", "qkv triton": "qkv", "rope + cache write": "rope + cache",
          "attention": "attention", "o triton": "o", "moe": "moe"}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--no-stages", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/pdl_step.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    config = ModelConfig.from_dict(preset_config("120b"))
    rows, weights = [], None
    for batch in args.batch:
        steps = {}
        for name, pdl, pdl_moe in [("plain", False, False), ("pdl", True, True),
                                   ("pdl but moe", True, False)]:  # fmt: skip
            steps[name] = DecodeStep(config, batch=batch, context=1024, weights=weights,
                                     seed=seed, pdl=pdl, pdl_moe=pdl_moe)  # fmt: skip
            weights = steps[name].weights
        plain_logits = graph_logits(steps["plain"])
        for name, step in steps.items():
            same = torch.equal(plain_logits, graph_logits(step))
            rows.append({"batch": batch, "stage": f"whole step ({name})", "pdl": name != "plain",
                         "us": round(us(step), 1), "logits_identical": same})  # fmt: skip
            logger.info("%s", rows[-1])
        if args.no_stages or batch != args.batch[0]:
            continue
        for pdl in (False, True):
            for key, (fn, _) in stages(steps["plain"], pdl).items():
                if key not in STAGES:
                    continue
                name = STAGES[key]
                rows.append({"batch": batch, "stage": name, "pdl": pdl, "us": round(us(fn), 1)})
                logger.info("%s", rows[-1])
        del steps
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    out = sys.stdout
    out.write(f"\n{result['device']}  commit {result['commit'][:10]}\n")
    out.write(f"{'batch':>5} {'stage':26} {'plain us':>9} {'pdl us':>9} {'gain':>6}\n")
    plain = {(r["batch"], r["stage"].split(" (")[0]): r["us"] for r in rows if not r["pdl"]}
    for r in rows:
        if r["pdl"]:
            base = plain[(r["batch"], r["stage"].split(" (")[0])]
            extra = (
                f"  logits identical: {r['logits_identical']}" if "logits_identical" in r else ""
            )
            out.write(f"{r['batch']:5d} {r['stage']:26} {base:9.1f} {r['us']:9.1f} "
                      f"{base / r['us']:6.3f}{extra}\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
