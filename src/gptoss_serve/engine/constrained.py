"""A request's grammar as the sampler's ``TokenConstraint``, its masks computed off-thread (the
CPU engine and ``generate``, one sequence at a time; the GPU engine does its batch's rows
together: grammar_batch.py).

After a token is drawn, ``advance`` hands (consume the token, compute the next mask) to a small
thread pool and returns at once; the model's forward pass for that token runs meanwhile, and
the next ``bitmask`` call waits for the result. llguidance releases the GIL while it works, so
the two really overlap. A grammar that refuses the token or allows nothing raises
``ConstraintError`` from ``bitmask``: the engine fails that request, it never hangs.
"""

from __future__ import annotations

import concurrent.futures
import logging

import numpy as np
import torch

from gptoss_serve.constrain import adapter

logger = logging.getLogger(__name__)


class GrammarConstraint:
    """One request's matcher, with its mask buffer and the pending mask computation."""

    def __init__(self, grammar: str, pool: concurrent.futures.Executor) -> None:
        self._matcher = adapter.new_matcher(grammar)
        self._pool = pool
        self._bitmask = np.zeros(adapter.num_mask_words(), dtype=np.int32)
        self._pending: concurrent.futures.Future | None = None

    def start(self) -> None:
        self._pending = self._pool.submit(self._matcher.fill_bitmask, self._bitmask)

    def bitmask(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("bitmask() before start() or advance()")
        pending, self._pending = self._pending, None
        pending.result()  # re-raises the matcher's ConstraintError
        return torch.from_numpy(self._bitmask)

    def advance(self, token_id: int) -> None:
        # The buffer is free: the sampler has read it before the token was drawn.
        self._pending = self._pool.submit(self._consume_and_fill, token_id)

    def _consume_and_fill(self, token_id: int) -> None:
        self._matcher.consume(token_id)
        self._matcher.fill_bitmask(self._bitmask)

    def cancel(self) -> None:
        """Wait for the pending computation so the buffer outlives it (errors are moot)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._pending = None
