"""The engine's decode rate with every request asking for log-probabilities, against none
asking (GPU machine, synthetic-120b): what `include: ["message.output_text.logprobs"]` costs a
served request.

    cd bench && python3 logprobs_engine.py [--batches 1 64] [--rounds 2]
                                           [--out results/logprobs_engine.json]

``decode_tok_s`` as `gptoss-serve bench` times it (1k-token random prompts, temperature 1,
top_p 1), once per setting in turn (none, 0, 5, 20 alternatives), ``--rounds`` times, on one
engine built once: the runs alternate, as the board's power state moves such figures by a
few percent between runs (bench/RESULTS.md e36).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.synthetic_weights import synthetic_model_config, synthetic_weights
from kernels import write_results

logger = logging.getLogger("bench.logprobs_engine")
SETTINGS = (None, 0, 5, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens a request")
    parser.add_argument("--out", type=Path, default=Path("results/logprobs_engine.json"))
    args = parser.parse_args()
    weights = synthetic_weights(synthetic_model_config("synthetic-120b"), device="cuda")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(args.batches)))
    make_core, _, _ = build_engine(weights, config)
    model = weights.config
    eb.decode_tok_s(make_core, model, batch=1, context=1024, num_tokens=16)  # untimed first
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for logprobs in SETTINGS:
                rate = eb.decode_tok_s(make_core, model, batch=batch, context=1024,
                                       num_tokens=args.tokens, logprobs=logprobs)  # fmt: skip
                runs.setdefault(f"{batch}/{logprobs}", []).append(round(rate, 1))
                logger.info("batch %d logprobs %s: %.1f tok/s", batch, logprobs, rate)
    sys.stdout.write(f"{'batch':>5} {'logprobs':>9} {'tok/s (median)':>15}  runs\n")
    for key, rates in runs.items():
        batch, logprobs = key.split("/")
        sys.stdout.write(f"{batch:>5} {logprobs:>9} {statistics.median(rates):15.1f}  {rates}\n")
    write_results(args.out, tokens=args.tokens, runs=runs)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
