"""A memoizing decorator for functions of one string whose cache memory stays bounded.

Used where a client's text is the key and a check or compile is worth keeping: the server's
JSON Schema checks (server/protocol.py) and the grammar compiler (constrain/adapter.py). An
agent sends the same tools with every request, so those are worth caching; a client could
also send ever-new 60 MB schemas, which must not pile up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

Result = TypeVar("Result")


def bounded_cache(
    maxsize: int, max_key_chars: int
) -> Callable[[Callable[[str], Result]], Callable[[str], Result]]:
    """``functools.lru_cache(maxsize)`` for keys of at most ``max_key_chars`` characters; a
    longer key is computed on every call and never kept, so the cache holds at most
    ``maxsize x max_key_chars`` characters of keys. The wrapper has the cache's
    ``cache_info`` and ``cache_clear``."""

    def decorate(function: Callable[[str], Result]) -> Callable[[str], Result]:
        cached = functools.lru_cache(maxsize=maxsize)(function)

        @functools.wraps(function)
        def call(key: str) -> Result:
            return cached(key) if len(key) <= max_key_chars else function(key)

        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return call

    return decorate
