"""The grammars of the requests one engine core runs: each step's sampled tokens consumed and
the next step's masks computed for the whole batch at once.

Every API request carries a grammar (its reasoning budget, bench/RESULTS.md e16), so a decode
batch of N requests needs N masks a step. One worker-thread job per request took the GIL back
from the engine's thread once a mask: at 160 requests on an H100 (FP8 cache, 171 seats;
bench/grammar_load.py) 9.1-9.4 ms a step. Here the grammar library's batch calls do all
rows in one call each, on its own threads: 3.7-4.3 ms for the masks and 1.8-2.0 ms for the
advance (bench/RESULTS.md e25). The masks are written into the runner's pinned buffer
(``allocate``), whose upload does not wait for the device.

A token a grammar refuses, or a grammar that allows nothing next, fails that request at the
next step that samples it (``bitmask`` reports it); the batch goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from gptoss_serve.constrain import adapter

logger = logging.getLogger(__name__)


def _empty(rows: int, words: int) -> torch.Tensor:
    return torch.empty((rows, words), dtype=torch.int32)


class BatchGrammars:
    """Each grammar-bound request's matcher, by request id, and why it failed (if it did)."""

    def __init__(self) -> None:
        self._matchers: dict[str, adapter.Matcher] = {}
        self._errors: dict[str, str] = {}  # refused tokens, reported by the next ``bitmask``

    def add(self, request_id: str, grammar: str) -> None:
        """Raises GrammarError for a grammar the library cannot compile."""
        self._matchers[request_id] = adapter.new_matcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._errors.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def advance(self, tokens: Mapping[str, int]) -> None:
        """Consume each request's sampled token (requests without a grammar, or already failed,
        are skipped)."""
        pairs = [
            (request_id, token)
            for request_id, token in tokens.items()
            if request_id in self._matchers and request_id not in self._errors
        ]
        if not pairs:
            return
        reasons = adapter.consume_tokens([(self._matchers[r], token) for r, token in pairs])
        for (request_id, _), reason in zip(pairs, reasons, strict=True):
            if reason is not None:
                self._errors[request_id] = reason

    def bitmask(
        self, request_ids: Sequence[str], allocate: Callable[[int, int], torch.Tensor] = _empty
    ) -> tuple[torch.Tensor | None, dict[str, str]]:
        """The masks of a step's sampled rows (int32 [rows, words]; -1, everything allowed, on
        rows without a grammar), or None when no row has one; and the requests that failed ->
        why. ``allocate(rows, words)`` gives the CPU tensor they are written into (the
        runner's pinned buffer, whose upload does not wait for the device)."""
        rows = [(row, r) for row, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return None, {}
        masks = allocate(len(request_ids), adapter.num_mask_words())
        bitmask = masks.numpy()
        reasons = {r: self._errors[r] for _, r in rows if r in self._errors}
        live = [(row, r) for row, r in rows if r not in reasons]
        # Every other row allows everything (the library writes the live ones whole: filling
        # the whole buffer first cost ~3 ms a step at 960 rows).
        filled = {row for row, _ in live}
        for row in range(len(request_ids)):
            if row not in filled:
                bitmask[row] = -1
        if live:
            found = adapter.fill_bitmasks([(self._matchers[r], row) for row, r in live], bitmask)
            for (row, request_id), reason in zip(live, found, strict=True):
                if reason is not None:
                    reasons[request_id] = reason
                    bitmask[row] = -1  # its token is not used; keep the row finite to sample
        failed = {}
        for request_id, reason in reasons.items():
            logger.warning("request %s: grammar failed: %s", request_id, reason)
            failed[request_id] = f"constrained decoding failed: {reason}"
        return masks, failed
