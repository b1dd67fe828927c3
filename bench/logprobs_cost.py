"""What returning log-probabilities adds to a decode step on the GPU: ``ModelRunner``'s
``launch_logprobs`` (the log-softmax normaliser, the drawn token's value and the top k of
the 201,088-token vocabulary, per row asking: the Triton kernels of kernels/_logprobs.py, and
the torch reference they replaced) and its copy back with the tokens.

    python bench/logprobs_cost.py [--out bench/results/logprobs_cost.json]

Random fp32 logits of each batch size, every row asking (the most work); times are medians of
CUDA-graph-free launches (``triton.testing.do_bench``, which flushes L2 between runs: the
logits of a real step are fresh from the unembedding, mostly in L2, so this is an upper
bound), and of the whole ``sample_async`` with and without the rows asking.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from gptoss_serve.engine.model_runner import LogprobTensors, SampledTokens
from gptoss_serve.kernels.sampling import sample_tokens, token_logprobs, token_logprobs_reference
from kernels import write_results

logger = logging.getLogger("bench.logprobs_cost")
VOCAB = 201_088


def _sample_and_read(logits: torch.Tensor, k: int | None) -> list[int]:
    """A step's sampling and read-back as the runner does it (greedy rows)."""
    rows = logits.shape[0]
    zeros = torch.zeros(rows, device=logits.device)
    ints = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    tokens = sample_tokens(logits, zeros, zeros + 1, ints, ints, nucleus=False)
    logprobs = None
    if k is not None:
        logprobs = LogprobTensors(list(range(rows)), *token_logprobs(logits, tokens, k))
    host = torch.empty(rows, dtype=torch.int64, pin_memory=True)
    sampled = SampledTokens(tokens, host, logprobs)
    values = sampled.tolist()
    sampled.logprobs()
    return values


def _measure(batch: int) -> dict[str, float]:
    logits = torch.randn(batch, VOCAB, device="cuda") * 3
    tokens = torch.randint(0, VOCAB, (batch,), device="cuda")
    row: dict[str, float] = {"batch": batch}
    row["torch_k5_us"] = 1e3 * do_bench(lambda: token_logprobs_reference(logits, tokens, 5))
    for k in (0, 5, 20):
        row[f"launch_k{k}_us"] = 1e3 * do_bench(lambda k=k: token_logprobs(logits, tokens, k))
    for label, k in (("none", None), ("k5", 5)):
        row[f"sample_read_{label}_us"] = 1e3 * do_bench(lambda k=k: _sample_and_read(logits, k))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/logprobs_cost.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args()
    torch.manual_seed(0)
    table = []
    for batch in args.batches:
        table.append(_measure(batch))
        logger.info("%s", table[-1])
    sys.stdout.write(f"{'batch':>6} {'torch k=5':>10} {'k=0':>8} {'k=5':>8} {'k=20':>8} "
                     f"{'step read':>10} {'+ k=5':>8}  (us)\n")  # fmt: skip
    for row in table:
        sys.stdout.write(f"{row['batch']:>6} {row['torch_k5_us']:10.1f} "
                         f"{row['launch_k0_us']:8.1f} {row['launch_k5_us']:8.1f} "
                         f"{row['launch_k20_us']:8.1f} {row['sample_read_none_us']:10.1f} "
                         f"{row['sample_read_k5_us']:8.1f}\n")  # fmt: skip
    write_results(args.out, rows=table)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
