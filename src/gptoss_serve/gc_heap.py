"""The process's start-up heap kept out of Python's cyclic garbage collector.

Everything a server builds before its first request (torch and the web stack's modules, the
weights' Python objects, compiled kernels, the vocabulary, the grammar caches) lives until the
process ends, yet every collection of the oldest generation walks all of it, holding the GIL:
335k tracked objects and 160-175 ms a collection for the CPU demo server on a CI core. Under
load such collections come every second or so (a CPU harness of the engine core at 960
requests with grammars: one every ~65 steps, 106-133 ms each, the step's p99 106-122 ms),
stalling the engine's steps and every stream. ``freeze_startup_heap`` collects once and moves
what is left to the permanent generation (``gc.freeze``, as vLLM's engine core does after its
start-up), so later collections walk only what requests create (the harness's p99 36-38 ms,
no step over 60 ms: bench/RESULTS.md s6).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object still tracked; returns how many are frozen now."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap: %d objects frozen out of garbage collection (%.0f ms)", frozen,
                (time.perf_counter() - started) * 1e3)  # fmt: skip
    return frozen


def thaw_startup_heap() -> None:
    """Give the frozen objects back to the collector."""
    gc.unfreeze()


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[int]:
    """The start-up heap frozen while the body runs (a server's life), thawed after it: a
    server shutting down inside a longer process (the tests) leaves no objects frozen."""
    frozen = freeze_startup_heap()
    try:
        yield frozen
    finally:
        thaw_startup_heap()
