"""Piecewise CUDA graphs of the steps with prefills: everything but attention, captured per
padded size.

A step with a prefill chunk runs eagerly (its attention is ragged), and issuing a 120b
forward pass eagerly takes the H200 machine's host 37-50 ms, more than the device needs up
to ~1k tokens (18 ms of kernels at 128 tokens, 28 at 512; bench/prefill_gap.py,
bench/RESULTS.md e31). Here such a step of up to ``max(sizes)`` tokens is padded at its end
to a captured size, and its forward pass is L + 1 graph replays with the L attentions run
eagerly between them (engine/forward.py's pieces): piece 0 is the embedding, layer 0's input
norm and q/k/v; piece i + 1 is layer i's o projection, norm and MoE and layer i + 1's norm
and q/k/v; the last piece ends at the last MoE. The logits of the sampled rows are computed
eagerly after the last replay (their count varies).

The pieces pass their q, residual and MoE output through static buffers of the largest
size's rows, so one pool serves every piece and size (the decode graphs' pool, captured
first). Padding rows are token 0 at position 0 with slot -1 (no K/V written), left out of the
MoE by ``valid_rows``, and never attended or sampled; the attention reads and writes only the
step's rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gptoss_serve.engine.cuda_graphs import smallest_holding
from gptoss_serve.engine.forward import first_piece, next_piece
from gptoss_serve.engine.input_batch import StepInputs
from gptoss_serve.engine.kv_cache import KvCacheTensors
from gptoss_serve.engine.ops import Ops
from gptoss_serve.engine.weights import ModelWeights

logger = logging.getLogger(__name__)

_SIZES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def piece_sizes(max_tokens: int, budget: int) -> tuple[int, ...]:
    """Captured sizes up to ``max_tokens`` (0: none) and the step's token budget."""
    return tuple(size for size in _SIZES if size <= min(max_tokens, budget))


# What runs a layer's attention between two replays: (layer, q [T, A, D], out [T, A, D]).
Attend = Callable[[int, torch.Tensor, torch.Tensor], None]


class PiecewiseGraphs:
    def __init__(
        self, sizes: tuple[int, ...], weights: ModelWeights, kv: KvCacheTensors, ops: Ops
    ) -> None:
        if not sizes:
            raise ValueError("piecewise graphs need at least one size")
        self.sizes = tuple(sorted(sizes))
        self.weights, self.kv, self.ops = weights, kv, ops
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        config = weights.config
        rows, device, dtype = self.sizes[-1], weights.device, weights.dtype
        q_shape = (rows, config.num_attention_heads, config.head_dim)
        # Static buffers every piece of every size reads and writes (the first rows of).
        self._q = torch.zeros(q_shape, dtype=dtype, device=device)
        self._attention = torch.zeros(q_shape, dtype=dtype, device=device)
        self._residual = torch.zeros(rows, config.hidden_size, dtype=dtype, device=device)
        self._x = torch.zeros(rows, config.hidden_size, dtype=dtype, device=device)

    @property
    def num_pieces(self) -> int:
        return len(self.weights.layers) + 1

    def capture(self, prepare: Callable[[int], StepInputs], pool=None) -> None:
        """``prepare(size)``: a step of ``size`` padding rows in the runner's buffers (their
        device views are the ones every step of that size reads). Largest size first; each
        piece runs once outside its graph (Triton compiles, cuBLAS picks its algorithms).
        ``pool``: the decode graphs' memory pool to share (None: the first graph's own)."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            inputs = prepare(size)
            graphs = []
            for piece in range(self.num_pieces):
                self._run_piece(piece, size, inputs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._run_piece(piece, size, inputs)
                if pool is None:
                    pool = graph.pool()
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize()
        logger.info("captured %d piecewise graphs (%d pieces at %d sizes, %d..%d tokens) in "
                    "%.1fs", self.num_pieces * len(self.sizes), self.num_pieces,
                    len(self.sizes), self.sizes[0], self.sizes[-1],
                    time.perf_counter() - started)  # fmt: skip

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size holding ``num_tokens`` rows (None: too many)."""
        return smallest_holding(self.sizes, num_tokens) if self._graphs else None

    def run(
        self, size: int, num_tokens: int, inputs: StepInputs, attend: Attend
    ) -> tuple[torch.Tensor, ...]:
        """The forward pass of a step of ``num_tokens`` rows padded to ``size``, whose
        ``inputs`` are already in the runner's buffers (the graphs read them there): the last
        MoE's output and the residual, [size, H] (rows past ``num_tokens`` are padding)."""
        del inputs  # read by the graphs from the buffers they were captured over
        graphs = self._graphs[size]
        return self._run_pieces(size, num_tokens, attend, lambda piece: graphs[piece].replay())

    def run_eagerly(
        self, size: int, num_tokens: int, inputs: StepInputs, attend: Attend
    ) -> tuple[torch.Tensor, ...]:
        """``run`` with the pieces launched eagerly instead of replayed: the same work, on any
        device (tests compare it with engine/forward.py's ``forward`` on CPU)."""
        return self._run_pieces(size, num_tokens, attend,
                                lambda piece: self._run_piece(piece, size, inputs))  # fmt: skip

    def _run_pieces(
        self, size: int, num_tokens: int, attend: Attend, launch: Callable[[int], None]
    ) -> tuple[torch.Tensor, ...]:
        """``launch(piece)`` for every piece, each layer's attention between two of them."""
        q, out = self._q[:num_tokens], self._attention[:num_tokens]
        for piece in range(self.num_pieces):
            if piece:
                attend(piece - 1, q, out)
            launch(piece)
        return self._x[:size], self._residual[:size]

    def _run_piece(self, piece: int, size: int, inputs: StepInputs) -> None:
        weights, kv, ops, metadata = self.weights, self.kv, self.ops, inputs.metadata
        if piece == 0:
            q, residual = first_piece(weights, kv, ops, inputs.input_ids, metadata)
        else:
            q, x, residual = next_piece(
                weights, kv, ops, piece - 1, self._attention[:size], self._residual[:size],
                metadata, valid_rows=inputs.valid_rows,
            )  # fmt: skip
            if q is None:
                self._x[:size].copy_(x)
        if q is not None:
            self._q[:size].copy_(q)
        self._residual[:size].copy_(residual)
