"""Runs of token ids by key, least recently used first out, bounded by the tokens kept.

Thread-safe (the server renders on its event loop, in worker threads and in worker
processes; responses end in worker threads). Used by ``replay.py`` (the tokens the model
generated for a message) and ``render.py`` (the tokens a prompt's header and its history
items render to). A run is kept as ``array('i')``: 4 bytes a token.
"""

from __future__ import annotations

import array
import threading
from collections import OrderedDict
from collections.abc import Sequence


class TokenLru:
    """At most ``max_tokens`` tokens of runs (0: nothing is kept)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._runs: OrderedDict[bytes, array.array] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def get(self, key: bytes) -> array.array | None:
        """The run kept under ``key`` (now the most recently used), or None."""
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
            return run

    def setdefault(self, key: bytes, tokens: Sequence[int]) -> array.array:
        """The run kept under ``key`` if there is one (the first stays), else ``tokens``,
        kept unless longer than the bound."""
        run = tokens if isinstance(tokens, array.array) else array.array("i", tokens)
        with self._lock:
            kept = self._runs.get(key)
            if kept is not None:
                self._runs.move_to_end(key)
                return kept
            if len(run) > self.max_tokens:
                return run
            self._runs[key] = run
            self._num_tokens += len(run)
            while self._num_tokens > self.max_tokens:
                _, evicted = self._runs.popitem(last=False)
                self._num_tokens -= len(evicted)
        return run
