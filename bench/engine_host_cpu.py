"""The engine core's host work per step at many requests, on a CPU machine (no GPU, no model).

The real `EngineCore`, scheduler, KV manager, `InputBatch` (on the CPU device) and grammars
(every request carries the API's reasoning-budget grammar, as served requests do), over a stub
runner: its forward pass only prepares the inputs, and its sampler takes the first of a few
text tokens that the row's mask allows (else the lowest allowed token), so the grammars go
through their real states. What is left is the host's side of a step: schedule, prepare, the
grammar masks and advance, update. Sessions without a GPU rebuilt this harness twice
(bench/RESULTS.md e27, s6); it is kept here.

    PYTHONPATH=src TIKTOKEN_ENCODINGS_BASE=../shared/vocab python3 bench/engine_host_cpu.py \\
        [--requests 960] [--steps 200] [--freeze] [--profile 25]

Prints the step's median, p99 and max, the steps over 60 ms, and the garbage collector's
collections by generation; ``--profile N`` adds cProfile's N costliest functions (the profile
inflates the step ~4x); ``--freeze`` freezes the start-up heap first, as the server does
(gc_heap.py).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from gptoss_serve.config import SamplingParams, SchedulerConfig
from gptoss_serve.constrain import grammar
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.input_batch import InputBatch
from gptoss_serve.engine.kv_manager import KvCacheManager
from gptoss_serve.engine.model_runner import SampledTokens
from gptoss_serve.engine.scheduler import Scheduler
from gptoss_serve.gc_heap import freeze_startup_heap

TEXT_TOKENS = (1236, 220, 290, 13, 11)  # ordinary tokens the analysis text takes
WARM_STEPS = 30  # the prefills and the first decodes, not timed


class StubRunner:
    """The ModelRunner's interface for EngineCore, with no model: inputs prepared, tokens
    picked from the masks."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.device = torch.device("cpu")
        self.batch = InputBatch(
            max_num_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len, num_groups=2, device=self.device,
        )  # fmt: skip

    def forward(self, output, previous=None):
        return None, self.batch.prepare(output)

    def mask_buffer(self, rows: int, words: int) -> torch.Tensor:
        return torch.empty((rows, words), dtype=torch.int32)

    def sample_async(self, logits, sampling, bitmask) -> SampledTokens:
        tokens = np.full(len(sampling.seeds), TEXT_TOKENS[0], dtype=np.int64)
        if bitmask is not None:
            for row, mask in enumerate(bitmask.numpy()):
                tokens[row] = _allowed_token(mask)
        return SampledTokens(torch.from_numpy(tokens), None)


def _allowed_token(mask: np.ndarray) -> int:
    for token in TEXT_TOKENS:
        if mask[token >> 5] >> (token & 31) & 1:
            return token
    word = int(np.flatnonzero(mask)[0])
    bits = int(mask[word]) & 0xFFFFFFFF
    return word * 32 + (bits & -bits).bit_length() - 1


class _Collections:
    """Count and time the collector's passes by generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.passes = {generation: [0, 0.0] for generation in range(3)}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        record = self.passes[info["generation"]]
        record[0] += 1
        record[1] += time.perf_counter() - self._started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=960)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--freeze", action="store_true", help="freeze the start-up heap first")
    parser.add_argument("--profile", type=int, default=0, help="print this many functions")
    args = parser.parse_args()
    config = SchedulerConfig(max_num_seqs=max(1024, args.requests), max_num_batched_tokens=8192,
                             max_model_len=4096)  # fmt: skip
    # Blocks for every request's whole length (64 + steps + 200 tokens): all of them run.
    full_blocks = args.requests * ((64 + args.steps + 200) // 16 + 2)
    sliding_blocks = args.requests * 10 + config.max_num_batched_tokens // 16 + 64
    kv = KvCacheManager(full_blocks, sliding_blocks, sliding_window=128,
                        enable_prefix_caching=True)  # fmt: skip
    core = EngineCore(Scheduler(config, kv), StubRunner(config), async_scheduling=True)
    text = grammar.build_grammar(grammar.ConstraintSpec(reasoning_budget=2048))
    if args.freeze:
        freeze_startup_heap()
    for index in range(args.requests):
        prompt = [(index * 7919 + j) % 200_000 for j in range(64)]
        params = SamplingParams(max_tokens=args.steps + 200, seed=index, grammar=text)
        core.add_request(f"r{index}", prompt, params)
    for _ in range(WARM_STEPS):
        core.step()
    collections = _Collections()
    profile = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        if profile:
            profile.enable()
        core.step()
        if profile:
            profile.disable()
        times.append(time.perf_counter() - started)
    ordered = sorted(times)
    sys.stdout.write(
        f"{args.requests} requests ({len(core.scheduler.running)} running), {args.steps} steps"
        f"{', start-up heap frozen' if args.freeze else ''} in {sum(times):.2f} s: step p50 "
        f"{statistics.median(times) * 1e3:.1f} ms, p99 "
        f"{ordered[int(0.99 * (len(ordered) - 1))] * 1e3:.1f} ms, max {ordered[-1] * 1e3:.1f} ms,"
        f" {sum(t > 0.06 for t in times)} over 60 ms\n"
    )
    for generation, (count, seconds) in collections.passes.items():
        sys.stdout.write(f"  gc generation {generation}: {count} passes, {seconds * 1e3:.1f} ms\n")
    if profile:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
