"""Prefill and decode speed of the plain-torch model on the built-in demo checkpoint.

A benchmark, not a test: it prints one table (figure, dtype, median, min, max, unit).

    .venv/bin/python bench/demo_decode.py [--device cpu|cuda] [--dtypes float32 bfloat16]

Each figure is measured ``--repeats`` times after one warm-up run:

* prefill: one forward pass over a 512-token prompt (``last_only=True``, as generate does);
* decode: batch 1, 256 greedy tokens after that prompt through ``generate`` with no stop
  tokens, so all 256 are produced; the rate counts the 255 single-token forward passes
  after the first token (the first token comes from the prefill).

The demo model is tiny (hidden 128, 4 layers) but keeps the real 201088-token vocabulary,
so the lm_head and the sampling over the vocabulary dominate decode.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gptoss_serve.checkpoint.demo import resolve_model_dir
from gptoss_serve.cli import cache_dir
from gptoss_serve.model import GptOssForCausalLM, load_model
from gptoss_serve.model.generate import SamplingParams, generate
from gptoss_serve.model.transformer import SUPPORTED_DTYPES

logger = logging.getLogger("bench.demo_decode")

PROMPT_TOKENS = 512
DECODE_TOKENS = 256
PROMPT_SEED = 0


def random_prompt(vocab_size: int, num_tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(model: GptOssForCausalLM, prompt_ids: list[int]) -> float:
    """Prompt tokens per second of one prefill pass."""
    token_ids = torch.tensor(prompt_ids, dtype=torch.long)
    synchronize(model.device)
    started = time.perf_counter()
    model(token_ids, model.new_cache(), last_only=True)
    synchronize(model.device)
    return len(prompt_ids) / (time.perf_counter() - started)


def time_decode(model: GptOssForCausalLM, prompt_ids: list[int]) -> float:
    """Generated tokens per second, from the first sampled token to the last."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, stop_token_ids=())
    stamps = [time.perf_counter() for _ in generate(model, prompt_ids, params)]
    if len(stamps) != DECODE_TOKENS:
        raise RuntimeError(f"expected {DECODE_TOKENS} tokens, generate gave {len(stamps)}")
    # Each yield follows an int() of the sampled token, so the device has finished by then.
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(run: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    """(median, min, max) of ``repeats`` runs after one warm-up run."""
    run()
    values = [run() for _ in range(repeats)]
    return statistics.median(values), min(values), max(values)


def write_table(rows: list[tuple[str, str, float, float, float, str]]) -> None:
    header = ("figure", "dtype", "median", "min", "max", "unit")
    cells = [header] + [
        (figure, dtype, f"{median:.1f}", f"{low:.1f}", f"{high:.1f}", unit)
        for figure, dtype, median, low, high, unit in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    sys.stdout.write("\n".join(line.rstrip() for line in lines) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument(
        "--dtypes", nargs="+", choices=tuple(SUPPORTED_DTYPES), default=["float32", "bfloat16"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model_dir("demo", cache_dir())
    logger.info(
        "demo model %s on %s, torch %s, %d threads",
        model_dir,
        args.device,
        torch.__version__,
        torch.get_num_threads(),
    )
    rows = []
    for dtype_name in args.dtypes:
        model = load_model(model_dir, dtype=SUPPORTED_DTYPES[dtype_name], device=args.device)
        prompt_ids = random_prompt(model.config.vocab_size, PROMPT_TOKENS)
        figures = (
            (f"prefill {PROMPT_TOKENS}-token prompt", time_prefill),
            (f"decode batch 1, {DECODE_TOKENS} tokens", time_decode),
        )
        for figure, timer in figures:
            logger.info("measuring %s in %s", figure, dtype_name)
            median, low, high = measure(functools.partial(timer, model, prompt_ids), args.repeats)
            rows.append((figure, dtype_name, median, low, high, "tok/s"))
    write_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
