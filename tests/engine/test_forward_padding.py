"""A padded (CUDA-graph sized) decode step through the batched forward pass on the CPU, with
the reference ops: the step's count of real rows reaches every layer's MoE, the real rows get
the logits of the unpadded step, and the padding rows' MoE output is zero."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import decode_step, tiny_model

from gptoss_serve.engine.cuda_graphs import graph_batch_sizes
from gptoss_serve.engine.forward import forward
from gptoss_serve.engine.input_batch import InputBatch
from gptoss_serve.engine.ops import REFERENCE_OPS
from gptoss_serve.kernels.moe import mxfp4_moe_reference


def test_a_padded_step_gives_its_real_rows_the_unpadded_logits() -> None:
    config, weights, kv = tiny_model(256)
    calls = []

    def moe(x: torch.Tensor, layer_weights, **kwargs) -> torch.Tensor:
        out = mxfp4_moe_reference(x, layer_weights, **kwargs)
        calls.append((x.shape[0], int(kwargs["valid_rows"][0]), out))
        return out

    ops = dataclasses.replace(REFERENCE_OPS, moe=moe)
    step = decode_step(1, [40, 17, 5])

    def run(decode_rows: int | None) -> torch.Tensor:
        batch = InputBatch(max_num_tokens=16, max_num_seqs=8, max_model_len=1024, num_groups=2,
                           device=torch.device("cpu"))  # fmt: skip
        inputs = batch.prepare(step, decode_rows=decode_rows)
        return forward(weights, kv, ops, inputs.input_ids, inputs.metadata,
                       valid_rows=inputs.valid_rows)  # fmt: skip

    padded = run(8)
    assert [(rows, count) for rows, count, _ in calls] == [(8, 3)] * config.num_hidden_layers
    for _, _, out in calls:
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    calls.clear()
    plain = run(None)
    assert [(rows, count) for rows, count, _ in calls] == [(3, 3)] * config.num_hidden_layers
    torch.testing.assert_close(padded[:3], plain, rtol=1e-5, atol=1e-5)


def test_only_graph_sizes_whose_moe_reads_the_count_are_padded() -> None:
    """The MoE's per-pair GEMVs (1-8 tokens) do not read valid_rows (kernels/moe.py): every
    decode batch that a graph pads lands on a size whose MoE tiles group the pairs."""
    pytest.importorskip("triton")
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415

    sizes = graph_batch_sizes(1024)
    for num_decodes in range(1, 1025):
        size = next(s for s in sizes if s >= num_decodes)
        assert size == num_decodes or decode_tiles_for(size).group_columns, size
