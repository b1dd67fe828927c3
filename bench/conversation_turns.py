"""A multi-turn dialogue against a running server, kept two ways: as a conversation
(``/v1/conversations``, each turn ``conversation=...``) and as a ``previous_response_id`` chain.
Each turn streams (after one untimed stream: the SDK's first builds its types); the table
gives, turn by turn, the prompt's tokens, how many of them the prefix cache served, and the
time to the first streamed token (first text or reasoning delta).

    python bench/conversation_turns.py --base-url http://127.0.0.1:8000 [--turns 8]
        [--words 150] [--output 64] [--model ID] [--out bench/results/conversation_turns.json]

Both ways render the same prompts (the same items and Harmony's rule for old reasoning), so
their cache hits and first-token times should agree; a gap would mean one of them renders
its history differently from what the model generated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import openai

FIRST_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta")  # fmt: skip
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
VOCABULARY = ("river", "stone", "cloud", "paper", "engine", "garden", "signal", "copper")


def _turn(client: openai.OpenAI, text: str, **link: Any) -> dict[str, Any]:
    started = time.perf_counter()
    first = final = None
    with client.responses.stream(input=text, **link) as stream:
        for event in stream:
            if first is None and event.type in FIRST_TOKEN_EVENTS:
                first = time.perf_counter() - started
            if event.type in TERMINAL_EVENTS:  # (the SDK's final response wants `completed`)
                final = event.response
    if final is None:
        raise RuntimeError("the stream ended without a terminal event")
    usage = final.usage
    return {
        "id": final.id,
        "status": final.status,
        "input_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
        "ttft_ms": None if first is None else round(first * 1000, 2),
        "total_ms": round((time.perf_counter() - started) * 1000, 2),
    }


def _dialogue(client: openai.OpenAI, model: str, messages: list[str], way: str, output: int):
    turns = []
    common = {"model": model, "max_output_tokens": output, "temperature": 0.0}
    conversation = client.conversations.create() if way == "conversation" else None
    previous = None
    for text in messages:
        if conversation is not None:
            turn = _turn(client, text, conversation=conversation.id, **common)
        else:
            turn = _turn(client, text, previous_response_id=previous, **common)
        previous = turn["id"]
        turns.append(turn)
    if conversation is not None:
        items = client.conversations.items.list(conversation.id, limit=100)
        turns[-1]["conversation_items"] = len(list(items))
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=150, help="words of each user message")
    parser.add_argument("--output", type=int, default=64, help="max_output_tokens a turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.base_url.rstrip('/')}/v1", api_key=args.api_key,
                           max_retries=0)  # fmt: skip
    model = args.model or client.models.list().data[0].id
    # The SDK's first stream in a process builds its event types (~0.3 s on the H200's host),
    # which would read as the first turn's time to first token: one stream first, not timed.
    _turn(client, "Hello", model=model, max_output_tokens=16)
    results = {}
    for index, way in enumerate(("conversation", "previous_response_id")):
        rng = random.Random(args.seed + index)  # the same length, other words: no shared cache
        messages = [" ".join(rng.choice(VOCABULARY) for _ in range(args.words))
                    for _ in range(args.turns)]  # fmt: skip
        results[way] = _dialogue(client, model, messages, way, args.output)
    lines = [f"{'turn':>4} | {'way':<20} | {'prompt':>6} | {'cached':>6} | {'out':>4} | "
             f"{'TTFT ms':>8} | {'total ms':>8}"]  # fmt: skip
    for turn in range(args.turns):
        for way, turns in results.items():
            t = turns[turn]
            lines.append(f"{turn + 1:>4} | {way:<20} | {t['input_tokens']:>6} | "
                         f"{t['cached_tokens']:>6} | {t['output_tokens']:>4} | "
                         f"{t['ttft_ms']!s:>8} | {t['total_ms']:>8}")  # fmt: skip
    sys.stdout.write("\n".join(lines) + "\n")
    report = {"commit": os.environ.get("BENCH_COMMIT"), "date": time.strftime("%Y-%m-%d"),
              "base_url": args.base_url, "model": model, "turns": args.turns,
              "words": args.words, "output": args.output, "results": results}  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
