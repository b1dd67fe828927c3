"""Runs one scheduled step on the device: inputs into persistent buffers, the forward pass
(a captured CUDA graph for decode-only steps; piecewise graphs with the attention between them
for other steps of up to ``piecewise_max_tokens`` tokens; eager otherwise), then sampling on
the device.

The only host sync per step is reading back the sampled tokens, which the scheduler and the
streams need. With async scheduling that read waits for one step while the next one, already
launched, runs: its decode rows whose token is still a placeholder take the token sampled for
their request on the device (``PreviousTokens``), and the tokens come back through pinned
buffers (``SampledTokens``) whose copy is queued before the next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from gptoss_serve.config import SchedulerConfig
from gptoss_serve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from gptoss_serve.engine.forward import attend, final_logits, forward
from gptoss_serve.engine.input_batch import InputBatch, StepInputs
from gptoss_serve.engine.kv_cache import KvCacheTensors
from gptoss_serve.engine.ops import KERNEL_OPS, Ops
from gptoss_serve.engine.piecewise_graphs import PiecewiseGraphs, piece_sizes
from gptoss_serve.engine.request import PLACEHOLDER_TOKEN
from gptoss_serve.engine.scheduler_output import SchedulerOutput
from gptoss_serve.engine.weights import ModelWeights
from gptoss_serve.kernels.sampling import apply_token_bitmask, needs_nucleus, token_logprobs

logger = logging.getLogger(__name__)

# A step of no requests: what the graphs' captures pad to their sizes.
_NO_REQUESTS = SchedulerOutput(
    step=-1, scheduled=(), num_decodes=0, preempted_request_ids=(), finished_request_ids=()
)


@dataclass(frozen=True)
class SamplingBatch:
    """Per logits row, in ``StepInputs.sampled_request_ids`` order (host lists)."""

    temperature: list[float]
    top_p: list[float]
    seeds: list[int]
    steps: list[int]  # index of the token being drawn (its number of output tokens so far)
    # Per row: None, or how many most likely tokens its log-probabilities come with.
    logprobs: list[int | None] | None = None

    @property
    def logprob_rows(self) -> list[int]:
        """The rows that return log-probabilities."""
        return [row for row, k in enumerate(self.logprobs or ()) if k is not None]


@dataclass(frozen=True)
class PreviousTokens:
    """The tokens a step still in flight samples, on the device, row by row."""

    request_ids: tuple[str, ...]
    tokens: torch.Tensor  # int64 [S]


@dataclass(frozen=True)
class LogprobTensors:
    """The log-probabilities of a step's rows that asked (``rows``, in order): the drawn
    token's [R] and the k most likely tokens' values and ids [R, k] (k: the rows' largest)."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> LogprobTensors:
        """Copies in pinned memory, queued (not waited for) on a GPU."""
        if self.chosen.device.type != "cuda":
            return self
        copies = []
        for tensor in (self.chosen, self.top_values, self.top_ids):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copies.append(host.copy_(tensor, non_blocking=True))
        return LogprobTensors(self.rows, *copies)

    def per_row(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """row -> (the drawn token's log-probability, the top (id, value) pairs)."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return {
            row: (chosen[i], list(zip(ids[i], values[i], strict=True)))
            for i, row in enumerate(self.rows)
        }


class SampledTokens:
    """A step's sampled tokens (and the log-probabilities of the rows that asked): on the
    device, and on their way to the host."""

    def __init__(
        self,
        tokens: torch.Tensor,
        host: torch.Tensor | None,
        logprobs: LogprobTensors | None = None,
    ) -> None:
        self.device = tokens
        self._host = host
        self._event = None
        self._logprobs = logprobs
        if host is not None:  # a pinned buffer: the copy is queued now, waited for in tolist
            host.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                self._logprobs = logprobs.to_host()
            self._event = torch.cuda.Event()
            self._event.record()

    def tolist(self) -> list[int]:
        if self._event is None:
            return self.device.tolist()
        self._event.synchronize()
        return self._host.tolist()

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """``LogprobTensors.per_row`` of the rows that asked ({} if none); call after
        ``tolist``."""
        return {} if self._logprobs is None else self._logprobs.per_row()


class ModelRunner:
    def __init__(
        self,
        weights: ModelWeights,
        kv: KvCacheTensors,
        config: SchedulerConfig,
        *,
        ops: Ops = KERNEL_OPS,
        use_cuda_graphs: bool = True,
        piecewise_max_tokens: int = 0,
    ) -> None:
        """``piecewise_max_tokens``: steps with prefills of up to this many tokens run on
        piecewise graphs (engine/piecewise_graphs.py; with the decode graphs only; 0: none)."""
        self.weights = weights
        self.kv = kv
        self.ops = ops
        self.device = weights.embedding.device
        self.batch = InputBatch(
            max_num_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_groups=len(set(kv.groups)) or 1,
            device=self.device,
        )
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs and self.device.type == "cuda" and ops.is_graph_safe:
            self.graphs = DecodeGraphs(graph_batch_sizes(config.max_num_seqs))
        self.pieces: PiecewiseGraphs | None = None
        sizes = piece_sizes(piecewise_max_tokens, config.max_num_batched_tokens)
        if self.graphs is not None and sizes:
            self.pieces = PiecewiseGraphs(sizes, weights, kv, ops)
        # Two pinned buffers in turn for the tokens read back: a step's may be in flight
        # while the one before is read.
        self._token_buffers = []
        if self.device.type == "cuda":
            self._token_buffers = [
                torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True)
                for _ in range(2)
            ]
        self._num_reads = 0
        # The grammar masks go up from a pinned buffer: a pageable upload of a batch's masks
        # (4.3 MB at 171 rows, 25 MB at 1024) first waits for the device to finish the forward
        # pass queued before it, which the host was meant to overlap (bench/RESULTS.md e25).
        self._mask_buffer: torch.Tensor | None = None
        self._mask_uploaded: torch.cuda.Event | None = None

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture(self._padding_inputs, self._decode_step)
        if self.pieces is not None:
            self.pieces.capture(self._padding_rows, pool=self.graphs.pool)

    def _padding_rows(self, size: int) -> StepInputs:
        """A step of ``size`` padding rows and no requests, as piecewise graphs capture it."""
        return self.batch.prepare(_NO_REQUESTS, pad_rows=size)

    def _padding_inputs(self, size: int) -> StepInputs:
        """A decode step of ``size`` padding rows (length 0, slot -1), as graphs capture it."""
        return self.batch.prepare(_NO_REQUESTS, decode_rows=size)

    def _decode_step(self, inputs: StepInputs) -> torch.Tensor:
        """The captured step: the graph reads each replay's count of real rows from the
        persistent ``valid_rows`` buffer, so the MoE skips that replay's padding rows."""
        return forward(
            self.weights, self.kv, self.ops, inputs.input_ids, inputs.metadata,
            valid_rows=inputs.valid_rows,
        )  # fmt: skip

    def forward(
        self, output: SchedulerOutput, previous: PreviousTokens | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """Queue the step's forward pass; returns float32 logits [S, V] of the sampled rows
        (not yet computed when this returns on a GPU) and the step's inputs. ``previous``:
        the step before, when it is still in flight (rows with a placeholder token take its
        tokens)."""
        size = piece_size = None
        if self.graphs is not None and output.num_decodes == len(output.scheduled):
            size = self.graphs.padded_size(output.num_decodes)
        elif self.pieces is not None:
            piece_size = self.pieces.padded_size(output.num_tokens)
        inputs = self.batch.prepare(output, decode_rows=size, pad_rows=piece_size)
        _take_previous_tokens(inputs.input_ids, output, previous)
        if size is not None:
            logits = self.graphs.replay(size)[: len(inputs.sampled_request_ids)]
        elif piece_size is not None:
            metadata = inputs.metadata

            def attend_layer(index: int, q: torch.Tensor, out: torch.Tensor) -> None:
                attend(self.weights, self.kv, self.ops, index, q, metadata, out)

            x, residual = self.pieces.run(piece_size, output.num_tokens, inputs, attend_layer)
            logits = final_logits(self.weights, self.ops, x, residual, inputs.logits_indices)
        else:
            logits = forward(
                self.weights,
                self.kv,
                self.ops,
                inputs.input_ids,
                inputs.metadata,
                logits_indices=inputs.logits_indices,
                valid_rows=inputs.valid_rows,
            )
        return logits, inputs

    def sample_async(
        self, logits: torch.Tensor, sampling: SamplingBatch, bitmask: torch.Tensor | None
    ) -> SampledTokens:
        """``launch_sampling`` (with the log-probabilities of the rows that ask) and the copy
        of its results to the host, not waited for."""
        tokens = self.launch_sampling(logits, sampling, bitmask)
        host = None
        if self._token_buffers:
            buffer = self._token_buffers[self._num_reads % len(self._token_buffers)]
            host = buffer[: tokens.shape[0]]
            self._num_reads += 1
        return SampledTokens(tokens, host, self.launch_logprobs(logits, tokens, sampling))

    def launch_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingBatch
    ) -> LogprobTensors | None:
        """The log-probabilities of the rows that ask for them, from the logits as the model
        gave them (before temperature, top-p and the grammar's mask); None if no row asks."""
        rows = sampling.logprob_rows
        if not rows:
            return None
        k = max(sampling.logprobs[row] for row in rows)
        if rows == list(range(len(rows))):
            picked = token_logprobs(logits[: len(rows)], tokens[: len(rows)], k)
        else:
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            picked = token_logprobs(logits, tokens.index_select(0, index), k, rows=index)
        return LogprobTensors(rows, *picked)

    def sample(
        self, logits: torch.Tensor, sampling: SamplingBatch, bitmask: torch.Tensor | None
    ) -> list[int]:
        """Draw one token per row (masked by ``bitmask`` [S, words] int32 if given): the
        step's one host sync."""
        if not sampling.seeds:
            return []
        return self.launch_sampling(logits, sampling, bitmask).tolist()

    def mask_buffer(self, rows: int, words: int) -> torch.Tensor:
        """Where the next sampling's grammar masks are written: int32 [rows, words] on the
        host, pinned on a GPU (its last upload waited for: free to write)."""
        if self.device.type != "cuda":
            return torch.empty((rows, words), dtype=torch.int32)
        if self._mask_buffer is None or self._mask_buffer.shape[1] != words:
            self._mask_buffer = torch.empty((self.batch.max_num_seqs, words), dtype=torch.int32,
                                            pin_memory=True)  # fmt: skip
        elif self._mask_uploaded is not None:
            self._mask_uploaded.synchronize()
        return self._mask_buffer[:rows]

    def launch_sampling(
        self, logits: torch.Tensor, sampling: SamplingBatch, bitmask: torch.Tensor | None
    ) -> torch.Tensor:
        """``sample`` without reading the tokens back: int64 [S] on the device."""
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask.to(self.device, non_blocking=True))
            if self._mask_buffer is not None and bitmask.is_pinned():
                self._mask_uploaded = torch.cuda.Event()
                self._mask_uploaded.record()
        temperature, top_p, seeds, steps = sampling_tensors(sampling, self.device)
        return self.ops.sample_tokens(
            logits, temperature, top_p, seeds, steps,
            nucleus=needs_nucleus(sampling.temperature, sampling.top_p),
        )  # fmt: skip


def sampling_tensors(
    sampling: SamplingBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_p, seeds, steps) of ``sampling`` on ``device``: float32, float32,
    int64, int64 [S], in one copy from one pinned buffer (seeds and steps, then temperature
    and top_p). Four copies from pageable tensors had run between the forward pass and the
    sampling kernels of every step (3.4 µs of device time at batch 1). The buffer comes from
    torch's caching host allocator, which reuses it only once the copy that reads it ran."""
    rows = len(sampling.seeds)
    host = torch.empty(24 * rows, dtype=torch.uint8, pin_memory=device.type == "cuda")
    array = host.numpy()
    array[: 16 * rows].view(np.int64)[:] = [*sampling.seeds, *sampling.steps]
    array[16 * rows :].view(np.float32)[:] = [*sampling.temperature, *sampling.top_p]
    packed = host.to(device, non_blocking=True)
    ints = packed[: 16 * rows].view(torch.int64)
    floats = packed[16 * rows :].view(torch.float32)
    return floats[:rows], floats[rows:], ints[:rows], ints[rows:]


def _take_previous_tokens(
    input_ids: torch.Tensor, output: SchedulerOutput, previous: PreviousTokens | None
) -> None:
    """Placeholder tokens (decode rows, first in the batch) <- the tokens ``previous`` samples
    for their requests, on the device: one copy when they line up, else a gather."""
    rows, sources = [], []
    index = None
    for row, entry in enumerate(output.scheduled):
        if entry.token_ids[-1] != PLACEHOLDER_TOKEN:
            continue
        if not entry.is_decode or row >= output.num_decodes:
            raise ValueError(f"request {entry.request_id}: a placeholder outside a decode row")
        if previous is None:
            raise ValueError(f"request {entry.request_id}: a placeholder token and no step before")
        if index is None:
            index = {request_id: i for i, request_id in enumerate(previous.request_ids)}
        rows.append(row)
        sources.append(index[entry.request_id])
    if not rows:
        return
    count = len(rows)
    if rows == sources == list(range(count)):
        input_ids[:count].copy_(previous.tokens[:count])
        return
    device = input_ids.device
    source = torch.tensor(sources, dtype=torch.int64).to(device, non_blocking=True)
    target = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    input_ids.index_copy_(0, target, previous.tokens.index_select(0, source))
