"""Token counts of long texts in short calls, for checks that must not stall the event loop.

The Harmony library's encode holds the GIL for the whole call (~0.2 s a MB of text), so one
call over a pasted 10 MB log stops every other request's stream for two seconds, even from a
worker thread. ``count_tokens`` encodes a text in runs of about ``RUN_CHARS`` characters (~13
ms each; other threads get the GIL between them) and stops once past a limit. The runs are cut
just before a space with an ASCII letter on both sides: o200k's pre-tokenizer always starts a
piece there (`` word``) and ends one before it, so the runs' counts add up to the text's.
A text with no such place is one run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from gptoss_serve.harmony import adapter

RUN_CHARS = 1 << 16
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


def runs(text: str, run_chars: int = RUN_CHARS) -> Iterator[str]:
    """``text`` in consecutive runs of at least ``run_chars`` characters (the last one shorter),
    each cut at a place where o200k starts a new pre-tokenizer piece."""
    start = 0
    while len(text) - start > run_chars:
        cut = _CUT.search(text, start + run_chars)
        if cut is None:
            break
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def count_tokens(text: str, limit: int | None = None, run_chars: int = RUN_CHARS) -> int:
    """``len(adapter.encode(text))``, counted run by run; with ``limit``, the counting stops
    once it reaches it, and the result (then ≥ limit) is a lower bound of the count."""
    total = 0
    for run in runs(text, run_chars):
        total += len(adapter.encode(run))
        if limit is not None and total >= limit:
            break
    return total
