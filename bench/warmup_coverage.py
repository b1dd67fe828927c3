"""Does the start-up warm-up meet every Triton kernel variant that serving meets? Builds the GPU
engine as `gptoss-serve serve` does (its defaults: the warm-up included), then runs a random
serving-like load through fresh engine cores and counts the kernel variants compiled (or
loaded) after the warm-up: each one is a request that waited seconds for it.

The load: waves of requests with prompt lengths from 1 token to past the token budget
(log-uniform, so chunked prefills too), short outputs, requests added while others decode (so
steps mix decodes at many contexts with prefill chunks), shared prefixes (prefill over a
cached prefix), greedy / temperature / nucleus sampling, and half the requests under the
server's default grammar (the reasoning budget: masked sampling).

    cd bench && python3 warmup_coverage.py [--model synthetic-120b] [--waves 12] [--seed N]
                                           [--out results/warmup_coverage.json]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import triton

from gptoss_serve.config import EngineConfig, SamplingParams, SchedulerConfig
from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from kernels import write_results

logger = logging.getLogger("bench.warmup_coverage")


class LateCompiles:
    """Chains onto the engine's jit_cache_hook (compile_watch) and keeps every variant."""

    def __init__(self) -> None:
        self.reprs: list[str] = []
        self._inner = triton.knobs.runtime.jit_cache_hook

    def __call__(self, **kwargs):
        self.reprs.append(kwargs["repr"][:400])
        return self._inner(**kwargs) if self._inner is not None else None


def _params(rng: random.Random, grammar: str | None, max_tokens: int) -> SamplingParams:
    temperature = rng.choice([0.0, 0.7, 1.0])
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=rng.choice([1.0, 0.9]),
        seed=rng.getrandbits(31), grammar=grammar if rng.random() < 0.5 else None,
    )  # fmt: skip


def run_wave(make_core, rng: random.Random, vocab: int, budget: int, grammar: str | None) -> int:
    """One wave: a first batch, then more requests every few steps; returns its steps."""
    core = make_core()
    ordinary = min(vocab, 200_000)  # the real vocabulary's ordinary tokens
    prefix = [rng.randrange(ordinary) for _ in range(rng.choice([300, 1500]))]
    num_steps = 0
    pending = rng.randint(1, 48)
    index = 0
    while pending or core.has_unfinished_requests:
        arrivals = pending if index == 0 else min(pending, rng.randint(0, 6))
        for _ in range(arrivals):
            length = int(math.exp(rng.uniform(0.0, math.log(1.6 * budget))))
            prompt = [rng.randrange(ordinary) for _ in range(max(length, 1))]
            if rng.random() < 0.25:
                prompt = prefix + prompt[:64]
            params = _params(rng, grammar, rng.randint(1, 48))
            core.add_request(f"w{index}", prompt, params)
            index += 1
        pending -= arrivals
        for _ in range(rng.randint(1, 5)):
            if not core.has_unfinished_requests:
                break
            result = core.step()
            if result.failed:
                raise RuntimeError(f"requests failed: {result.failed}")
            num_steps += 1
    core.close()
    return num_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synthetic-120b")
    parser.add_argument("--waves", type=int, default=12)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results/warmup_coverage.json")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    weights = synthetic_weights(synthetic_model_config(args.model), device="cuda",
                                dtype=torch.bfloat16)  # fmt: skip
    config = EngineConfig(scheduler=SchedulerConfig())  # the server's defaults
    started = time.perf_counter()
    make_core, _, _ = build_engine(weights, config)
    start_s = time.perf_counter() - started
    late = LateCompiles()
    triton.knobs.runtime.jit_cache_hook = late
    rng = random.Random(args.seed)
    grammar = build_grammar(ConstraintSpec(reasoning_budget=64))
    budget = config.scheduler.max_num_batched_tokens
    waves = []
    for wave in range(args.waves):
        before = len(late.reprs)
        began = time.perf_counter()
        steps = run_wave(make_core, rng, weights.config.vocab_size, budget, grammar)
        seconds = round(time.perf_counter() - began, 2)
        waves.append({"wave": wave, "steps": steps, "seconds": seconds,
                      "late_compiles": len(late.reprs) - before})  # fmt: skip
        logger.info("wave %d: %s", wave, waves[-1])  # written each wave: a cut run keeps them
        write_results(args.out, model=args.model, seed=args.seed, engine_start_s=round(start_s, 1),
                      late_compiles=late.reprs, waves=waves)  # fmt: skip
    sys.stdout.write(f"\n{'model':<16}{'engine start s':>16}{'waves':>7}{'steps':>7}"
                     f"{'late compiles':>15}\n")  # fmt: skip
    sys.stdout.write(f"{args.model:<16}{start_s:>16.1f}{len(waves):>7}"
                     f"{sum(w['steps'] for w in waves):>7}{len(late.reprs):>15}\n")  # fmt: skip
    for name in late.reprs:
        sys.stdout.write(f"  late: {name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
