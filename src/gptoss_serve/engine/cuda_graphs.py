"""CUDA graphs of the decode step: one per padded batch size, captured once at start-up.

This module owns the padded sizes and the captured graphs with their output tensors; the
graphs read and write the runner's persistent input buffers and the KV cache, so replaying one
after refilling the buffers runs the step on new values. The model knows nothing of graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# Every size up to 8, then steps of 8 to 64, of 16 to 128, of 32 beyond: padding wastes at
# most an eighth of a decode step's rows past 64.
_SMALL = (1, 2, 3, 4, 5, 6, 7, 8)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [*_SMALL, *range(16, 65, 8), *range(80, 129, 16), *range(160, 1025, 32)]
    capped = [s for s in sizes if s < max_num_seqs]
    return (*capped, max_num_seqs)


def smallest_holding(sizes: tuple[int, ...], rows: int) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``rows`` rows (None: none does)."""
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if index < len(sizes) else None


class DecodeGraphs:
    def __init__(self, batch_sizes: tuple[int, ...]) -> None:
        self.batch_sizes = tuple(sorted(batch_sizes))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._logits: torch.Tensor | None = None  # every graph's logits, rows of the largest

    def capture(
        self, prepare: Callable[[int], object], run: Callable[[object], torch.Tensor]
    ) -> None:
        """``prepare(size)`` fills the first ``size`` rows of the runner's buffers (padding)
        and returns the step's inputs, outside the graph (host work and uploads are not part
        of it); ``run(inputs)`` is the decode step on them, returning its logits. Largest size
        first, so the smaller graphs fit in the memory pool the largest one reserved.

        Every graph ends by copying its logits into one buffer of the largest size's rows,
        which is what ``replay`` returns (a step's logits are sampled before the next step's
        replay, in stream order). A logits tensor kept per graph stayed live in the pool, one
        [size, vocab] float32 block each: 13.9 GB over the sizes up to 1024 seats, which the
        KV cache's sizing did not see (synthetic-20b at 1024 seats ran out of memory on an
        80 GB H100; bench/RESULTS.md e25)."""
        started = time.perf_counter()
        for size in reversed(self.batch_sizes):
            inputs = prepare(size)
            warm = run(inputs)  # outside the graph: Triton compiles, cuBLAS picks algorithms
            if self._logits is None:
                self._logits = torch.empty_like(warm)
            del warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            out = self._logits[:size]
            with torch.cuda.graph(graph, pool=self._pool):
                out.copy_(run(inputs))
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch %d..%d) in %.1fs",
            len(self._graphs),
            self.batch_sizes[0],
            self.batch_sizes[-1],
            time.perf_counter() - started,
        )

    @property
    def pool(self):
        """The graphs' memory pool (None before the capture): piecewise graphs share it."""
        return self._pool

    def padded_size(self, num_decodes: int) -> int | None:
        """The smallest captured size holding ``num_decodes`` rows (None: too many)."""
        return smallest_holding(self.batch_sizes, num_decodes) if self._graphs else None

    def replay(self, size: int) -> torch.Tensor:
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
