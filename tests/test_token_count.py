"""Token counts of long texts by runs (harmony/token_count.py) against one encode of the text."""

from __future__ import annotations

import random

import pytest

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.token_count import count_tokens, runs

# Pieces that stress o200k's pre-tokenizer at the cuts: contractions, digits, punctuation
# before and after spaces, runs of spaces and newlines, capitals, non-ASCII letters and marks.
_WORDS = [
    "the",
    "The",
    "don't",
    "I'll",
    "a",
    "Zebra",
    "x",
    "naïve",
    "école",
    "über",
    "東京",
    "123",
    "4567",
    "3.14",
    "--",
    "...",
    "(",
    ")",
    '"',
    "'",
    "ok!",
    "e\u0301",
    "CamelCase",
]
_SEPARATORS = [" ", " ", " ", "  ", "\n", " \n", "\n\n", "\t", ", ", ". ", " - ", ""]


def random_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(_WORDS) + rng.choice(_SEPARATORS) for _ in range(words))


@pytest.mark.parametrize("seed", range(6))
def test_runs_add_up_to_the_texts_count(seed: int) -> None:
    rng = random.Random(seed)
    text = random_text(rng, 4000)
    pieces = list(runs(text, run_chars=rng.choice([7, 50, 300])))
    assert "".join(pieces) == text and len(pieces) > 10
    assert sum(len(adapter.encode(piece)) for piece in pieces) == len(adapter.encode(text))
    assert count_tokens(text, run_chars=64) == len(adapter.encode(text))


def test_a_limit_stops_the_count_with_a_lower_bound() -> None:
    text = random_text(random.Random(9), 6000)
    total = len(adapter.encode(text))
    partial = count_tokens(text, limit=total // 4, run_chars=200)
    assert total // 4 <= partial < total // 2
    assert count_tokens(text, limit=total + 1, run_chars=200) == total


def test_a_text_without_cuts_is_one_run() -> None:
    text = "東京" * 1000 + "x" * 1000
    assert list(runs(text, run_chars=100)) == [text]
