"""What a compaction costs and gives, against a running server: a dialogue of ``--turns`` turns
chained by ``previous_response_id`` (each turn ``--words`` words of user text, answers of at
most ``--output`` tokens), then both ways of compacting it (official SDK calls):

- ``responses.compact`` on the chain's last response, then a turn that sends the compacted
  output back with a new message;
- a turn on the chain with ``context_management`` (``compact_threshold`` below the prompt), so
  the response compacts first and answers from the summary.

Each line of the table: the call, its wall time, its prompt and output tokens, and for the
turns after a compaction the time to the first streamed token.

    python bench/compaction_turns.py --base-url http://127.0.0.1:8000 [--turns 6] [--words 400]
        [--output 256] [--model ID] [--out bench/results/compaction_turns.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import openai

logger = logging.getLogger("bench.compaction_turns")
VOCABULARY = ("river", "stone", "cloud", "paper", "engine", "garden", "signal", "copper")
FIRST_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


def _timed_stream(client: openai.OpenAI, **request: Any) -> tuple[Any, float, float]:
    """(final response, seconds to its first text or reasoning delta, seconds in all); the
    final response is the terminal event's (completed, or incomplete at the output cap)."""
    started = time.perf_counter()
    first = final = None
    for event in client.responses.create(stream=True, **request):
        if first is None and event.type in FIRST_TOKEN_EVENTS:
            first = time.perf_counter() - started
        if event.type in TERMINAL_EVENTS:
            final = event.response
    if final is None or final.status == "failed":
        raise RuntimeError(f"the response did not end well: {final}")
    return final, first or float("nan"), time.perf_counter() - started


def _row(call: str, seconds: float, usage: Any, ttft: float | None = None, **extra: Any) -> dict:
    row = {"call": call, "seconds": round(seconds, 3), "input_tokens": usage.input_tokens,
           "output_tokens": usage.output_tokens,
           "ttft_ms": None if ttft is None else round(ttft * 1e3, 1), **extra}  # fmt: skip
    logger.info(
        "%-34s %9.1f ms  in %6d  out %5d%s",
        call,
        seconds * 1e3,
        usage.input_tokens,
        usage.output_tokens,
        "" if ttft is None else f"  ttft {ttft * 1e3:7.1f} ms",
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=os.environ.get(
        "OPENAI_API_KEY", "none"), max_retries=0, timeout=600)  # fmt: skip
    model = args.model or client.models.list().data[0].id
    rng = random.Random(args.seed)
    common = {"model": model, "max_output_tokens": args.output, "temperature": 0}
    rows = []
    previous = None
    for turn in range(args.turns):
        response, ttft, seconds = _timed_stream(
            client, input=_text(rng, args.words), previous_response_id=previous, **common
        )
        previous = response.id
        rows.append(_row(f"turn {turn + 1}", seconds, response.usage, ttft))
    started = time.perf_counter()
    compact = client.responses.compact(model=model, previous_response_id=previous)
    kinds = [item.type for item in compact.output]
    rows.append(_row("responses.compact", time.perf_counter() - started, compact.usage,
                     items=kinds))  # fmt: skip
    sent_back = [item.model_dump(exclude_none=True) for item in compact.output]
    response, ttft, seconds = _timed_stream(
        client, input=[*sent_back, {"role": "user", "content": _text(rng, args.words)}], **common
    )
    rows.append(_row("turn after compact (items)", seconds, response.usage, ttft))
    threshold = max(1, rows[args.turns - 1]["input_tokens"] // 2)  # the chain's is over it
    response, ttft, seconds = _timed_stream(
        client, input=_text(rng, args.words), previous_response_id=previous,
        extra_body={"context_management": [{"type": "compaction",
                                            "compact_threshold": threshold}]}, **common,
    )  # fmt: skip
    kinds = [item.type for item in response.output]
    rows.append(_row("turn with context_management", seconds, response.usage, ttft,
                     items=kinds))  # fmt: skip
    if kinds[:1] != ["compaction"]:
        logger.error("the context_management turn did not compact: %s", kinds)
        return 1
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "base_url": args.base_url,
                    "model": model,
                    "turns": args.turns,
                    "words": args.words,
                    "output": args.output,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
