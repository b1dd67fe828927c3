"""User texts of an exact token length for the load generator: seeded random words.

Each text is ``[shared words] marker words...``: the shared words (``shared_prefix_len``
tokens, the same in every prompt) let a benchmark exercise the server's prefix cache on
purpose; the marker is a 9-digit number unique to the prompt, so that without shared words
two prompts differ from the first token of the user text on and the cache cannot help. (The
rendered system message before the user text is the same in every request either way.)
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from gptoss_serve.harmony import adapter

# A space and 3-10 lowercase letters. Such a token is a pre-token of its own after any word or
# number (o200k splits before each space-letter run), so N of them in a row encode to exactly
# N tokens whatever the order.
_WORD = re.compile(rb" [a-z]{3,10}")
_MARKER_DIGITS = 9  # three tokens: o200k splits digit runs into groups of three
# The most tokens a marker takes: the three digit groups, and a space after shared words.
MAX_MARKER_TOKENS = 4


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int  # of the text alone, as the harmony encoding counts it


@functools.cache
def word_pool() -> tuple[str, ...]:
    """The single-token words of the vocabulary, in id order (so a seed picks the same ones)."""
    vocabulary = adapter.vocabulary()
    ordered = sorted(vocabulary.ordinary.items(), key=lambda pair: pair[1])
    return tuple(text.decode() for text, _ in ordered if _WORD.fullmatch(text))


def make_prompts(
    num_prompts: int, num_tokens: int, *, seed: int, shared_prefix_len: int = 0
) -> list[Prompt]:
    """``num_prompts`` distinct user texts of ``num_tokens`` tokens each, the first
    ``shared_prefix_len`` of them common to all."""
    if num_tokens < shared_prefix_len + MAX_MARKER_TOKENS:
        raise ValueError(
            f"a prompt of {num_tokens} tokens cannot hold {shared_prefix_len} shared tokens "
            f"and a {MAX_MARKER_TOKENS}-token marker"
        )
    rng = random.Random(seed)
    pool = word_pool()
    shared = "".join(rng.choices(pool, k=shared_prefix_len))
    markers = rng.sample(range(10**_MARKER_DIGITS), num_prompts)
    prompts = []
    for marker in markers:
        marker_text = f"{marker:0{_MARKER_DIGITS}d}"
        head = f"{shared} {marker_text}" if shared else marker_text
        num_words = num_tokens - len(adapter.encode(head))
        text = head + "".join(rng.choices(pool, k=num_words))
        prompts.append(Prompt(text, len(adapter.encode(text))))
    return prompts
