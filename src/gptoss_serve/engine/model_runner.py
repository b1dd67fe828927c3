"""Runs one scheduled step on the device: inputs into persistent buffers, the forward pass
(a captured CUDA graph for decode-only steps, eager otherwise), then sampling on the device.

The only host sync per step is reading back the sampled tokens, which the scheduler and the
streams need.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gptoss_serve.config import SchedulerConfig
from gptoss_serve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from gptoss_serve.engine.forward import forward
from gptoss_serve.engine.input_batch import InputBatch, StepInputs
from gptoss_serve.engine.kv_cache import KvCacheTensors
from gptoss_serve.engine.ops import KERNEL_OPS, Ops
from gptoss_serve.engine.scheduler_output import SchedulerOutput
from gptoss_serve.engine.weights import ModelWeights
from gptoss_serve.kernels.sampling import apply_token_bitmask, needs_nucleus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingBatch:
    """Per logits row, in ``StepInputs.sampled_request_ids`` order (host lists)."""

    temperature: list[float]
    top_p: list[float]
    seeds: list[int]
    steps: list[int]  # index of the token being drawn (its number of output tokens so far)


class ModelRunner:
    def __init__(
        self,
        weights: ModelWeights,
        kv: KvCacheTensors,
        config: SchedulerConfig,
        *,
        ops: Ops = KERNEL_OPS,
        use_cuda_graphs: bool = True,
    ) -> None:
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

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture(self._padding_inputs, self._decode_step)

    def _padding_inputs(self, size: int) -> StepInputs:
        """A decode step of ``size`` padding rows (length 0, slot -1), as graphs capture it."""
        empty = SchedulerOutput(
            step=-1, scheduled=(), num_decodes=0, preempted_request_ids=(),
            finished_request_ids=(),
        )  # fmt: skip
        return self.batch.prepare(empty, decode_rows=size)

    def _decode_step(self, inputs: StepInputs) -> torch.Tensor:
        return forward(self.weights, self.kv, self.ops, inputs.input_ids, inputs.metadata)

    def forward(self, output: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Queue the step's forward pass; returns float32 logits [S, V] of the sampled rows
        (not yet computed when this returns on a GPU) and the step's inputs."""
        size = None
        if self.graphs is not None and output.num_decodes == len(output.scheduled):
            size = self.graphs.padded_size(output.num_decodes)
        inputs = self.batch.prepare(output, decode_rows=size)
        if size is not None:
            logits = self.graphs.replay(size)[: len(inputs.sampled_request_ids)]
        else:
            logits = forward(
                self.weights,
                self.kv,
                self.ops,
                inputs.input_ids,
                inputs.metadata,
                logits_indices=inputs.logits_indices,
            )
        return logits, inputs

    def sample(
        self, logits: torch.Tensor, sampling: SamplingBatch, bitmask: torch.Tensor | None
    ) -> list[int]:
        """Draw one token per row (masked by ``bitmask`` [S, words] int32 if given): the
        step's one host sync."""
        if not sampling.seeds:
            return []
        return self.launch_sampling(logits, sampling, bitmask).tolist()

    def launch_sampling(
        self, logits: torch.Tensor, sampling: SamplingBatch, bitmask: torch.Tensor | None
    ) -> torch.Tensor:
        """``sample`` without reading the tokens back: int64 [S] on the device."""
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask.to(self.device, non_blocking=True))
        device = self.device

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return self.ops.sample_tokens(
            logits,
            tensor(sampling.temperature, torch.float32),
            tensor(sampling.top_p, torch.float32),
            tensor(sampling.seeds, torch.int64),
            tensor(sampling.steps, torch.int64),
            nucleus=needs_nucleus(sampling.temperature, sampling.top_p),
        )
