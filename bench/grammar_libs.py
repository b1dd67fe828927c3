"""llguidance against xgrammar on the o200k_harmony vocabulary (201088 tokens), on the CPU.

A benchmark, not a test: it prints one table (library, schema, figure, value, unit).

    .venv/bin/python bench/grammar_libs.py [--steps 64] [--batch 32]

Figures, per library and JSON schema:

* compile: building a matcher for the schema from scratch (no cache), median of 5 runs;
* mask b1: computing one next-token bitmask for one request, median over a random walk of
  ``--steps`` tokens (each step draws a uniformly random allowed token and advances);
* mask b32: computing the bitmasks of ``--batch`` requests in one call of the library's
  batched API (its own thread pool), median per step, divided by the batch for a per-token
  figure in the ``per token`` row.

The row ``harmony`` is llguidance's grammar of a whole Harmony turn (analysis with a budget,
then a final message whose content is the ``nested`` schema, or a call to one of two tools),
which is what the server runs; xgrammar has no way to name special tokens in a grammar over a
raw byte vocabulary, so that row is llguidance only. xgrammar needs torch, transformers and
triton as install dependencies; llguidance has none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from gptoss_serve.constrain.grammar import ConstraintSpec, ToolConstraint, build_grammar
from gptoss_serve.harmony import adapter

SCHEMAS: dict[str, dict] = {
    "small": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
                "required": ["street", "zip"],
                "additionalProperties": False,
            },
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "tags", "address", "role"],
        "additionalProperties": False,
    },
    "large": {
        "type": "object",
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "price": {"type": "number"},
                    "label": {"type": ["string", "null"]},
                },
                "required": ["id", "price", "label"],
                "additionalProperties": False,
            }
        },
        "properties": {
            **{f"field_{i}": {"type": "string"} for i in range(30)},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        },
        "required": [*(f"field_{i}" for i in range(30)), "items"],
        "additionalProperties": False,
    },
}


def _median_time(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _allowed(bitmask_row: np.ndarray, size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:size]
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: adapter.Vocabulary) -> None:
        import llguidance  # noqa: PLC0415 (optional in this script)
        import llguidance.numpy  # noqa: PLC0415

        self.llg = llguidance
        self.size = vocab.size
        self.tokenizer = llguidance.LLTokenizer.from_tiktoken(
            encoder=vocab.ordinary, special_tokens=vocab.special,
            pattern=vocab.split_pattern, eos_token=200002, n_vocab=vocab.size,
        )  # fmt: skip
        self.executor = llguidance.LLExecutor()

    def grammar(self, schema: dict) -> str:
        return self.llg.LLMatcher.grammar_from_json_schema(schema)

    def compile(self, grammar: str):
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fork(self, matcher):
        return matcher.deep_copy()

    def bitmask(self, batch: int) -> np.ndarray:
        return self.llg.numpy.allocate_token_bitmask(batch, self.size)

    def fill(self, matcher, bitmask: np.ndarray, index: int) -> None:
        self.llg.numpy.fill_next_token_bitmask(matcher, bitmask, index)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        pairs = [(matcher, index) for index, matcher in enumerate(matchers)]
        self.llg.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id) and not matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: adapter.Vocabulary) -> None:
        import xgrammar  # noqa: PLC0415 (optional in this script)

        self.xgr = xgrammar
        self.size = vocab.size
        encoded = [b""] * vocab.size  # special tokens spell nothing in a raw vocabulary
        for token_bytes, token_id in vocab.ordinary.items():
            encoded[token_id] = token_bytes
        self.info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=[200002]
        )
        self.batch_matcher = xgrammar.BatchGrammarMatcher()

    def grammar(self, schema: dict) -> str:
        return json.dumps(schema)

    def compile(self, grammar: str):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return self.xgr.GrammarMatcher(compiler.compile_json_schema(grammar))

    def fork(self, matcher):
        return matcher.fork()

    def bitmask(self, batch: int) -> np.ndarray:
        return self.xgr.allocate_token_bitmask(batch, self.size).numpy()

    def fill(self, matcher, bitmask: np.ndarray, index: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, index)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id) and not matcher.is_terminated()


def _walk_batch(lib, template, batch: int, steps: int, seed: int) -> list[float]:
    """Per-step seconds of filling ``batch`` masks while random walks advance."""
    rng = np.random.default_rng(seed)
    matchers = [lib.fork(template) for _ in range(batch)]
    bitmask = lib.bitmask(batch)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        if batch == 1:
            lib.fill(matchers[0], bitmask, 0)
        else:
            lib.fill_batch(matchers, bitmask)
        times.append(time.perf_counter() - started)
        live = []
        for index, matcher in enumerate(matchers):
            allowed = _allowed(bitmask[index], lib.size)
            if len(allowed) and lib.accept(matcher, int(rng.choice(allowed))):
                live.append(matcher)
        matchers = live or [lib.fork(template) for _ in range(batch)]  # restart finished walks
        if len(matchers) < batch:
            matchers += [lib.fork(template) for _ in range(batch - len(matchers))]
    return times


def measure(lib, label: str, grammar: str, args: argparse.Namespace) -> list[tuple]:
    compile_s = _median_time(lambda: lib.compile(grammar), 5)
    template = lib.compile(grammar)
    single = statistics.median(_walk_batch(lib, template, 1, args.steps, seed=0))
    batched = statistics.median(_walk_batch(lib, template, args.batch, args.steps, seed=1))
    return [
        (lib.name, label, "compile", compile_s * 1e3, "ms"),
        (lib.name, label, "mask b1", single * 1e6, "us/token"),
        (lib.name, label, f"mask b{args.batch}", batched * 1e3, "ms/step"),
        (lib.name, label, f"mask b{args.batch} per token", batched / args.batch * 1e6, "us"),
    ]


def harmony_grammar() -> str:
    tools = tuple(
        ToolConstraint(name, SCHEMAS[schema])
        for name, schema in (("lookup", "small"), ("register", "nested"))
    )
    spec = ConstraintSpec(tools=tools, response_schema=SCHEMAS["nested"], reasoning_budget=32)
    return build_grammar(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    vocab = adapter.vocabulary()
    rows: list[tuple] = []
    for lib_class in (Llguidance, Xgrammar):
        started = time.perf_counter()
        try:
            lib = lib_class(vocab)
        except ImportError as error:
            rows.append((lib_class.name, "-", f"not installed ({error})", float("nan"), ""))
            continue
        rows.append((lib.name, "-", "tokenizer", (time.perf_counter() - started) * 1e3, "ms"))
        for label, schema in SCHEMAS.items():
            rows += measure(lib, label, lib.grammar(schema), args)
        if lib.name == "llguidance":
            rows += measure(lib, "harmony", harmony_grammar(), args)
    lines = [f"{'library':<11} {'schema':<8} {'figure':<22} {'value':>10} unit"]
    for name, label, figure, value, unit in rows:
        lines.append(f"{name:<11} {label:<8} {figure:<22} {value:>10.1f} {unit}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
