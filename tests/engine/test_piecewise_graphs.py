"""Piecewise graphs (engine/piecewise_graphs.py): a step with prefills padded to a captured
size, its pieces run with the attention between them, gives its rows the logits of the
whole forward pass (CPU, reference ops); the graphs' replays give what the same pieces give
launched eagerly (GPU); the padded input rows write no K/V and are left out of the MoE; the
runner sends the steps that fit a size through the pieces and the others eagerly (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import tiny_model

from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.cuda_graphs import smallest_holding
from gptoss_serve.engine.forward import attend, final_logits, forward
from gptoss_serve.engine.input_batch import InputBatch
from gptoss_serve.engine.model_runner import ModelRunner
from gptoss_serve.engine.ops import KERNEL_OPS, REFERENCE_OPS
from gptoss_serve.engine.piecewise_graphs import PiecewiseGraphs, piece_sizes
from gptoss_serve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from gptoss_serve.kernels.moe import mxfp4_moe_reference


def _mixed_step(new_prompt: int = 5) -> SchedulerOutput:
    """Two decodes (contexts 40 and 17), a prefill chunk at position 20 and a new prompt of
    ``new_prompt`` tokens: 2 + 9 + 5 = 16 rows. Request i owns blocks 100·i + j of both
    groups."""

    def entry(index: int, tokens: tuple[int, ...], computed: int) -> ScheduledRequest:
        blocks = tuple(range(100 * index, 100 * index + (computed + len(tokens)) // BLOCK_SIZE + 1))
        return ScheduledRequest(
            request_id=f"r{index}", token_ids=tokens, num_computed_tokens=computed,
            block_ids=(blocks, blocks), new_block_ids=((), ()), is_new=computed == 0,
            is_sampled=True,
        )  # fmt: skip

    scheduled = (
        entry(0, (11,), 40),
        entry(1, (12,), 17),
        entry(2, tuple(range(30, 39)), 20),
        entry(3, tuple(range(50, 50 + new_prompt)), 0),
    )
    return SchedulerOutput(
        step=3, scheduled=scheduled, num_decodes=2, preempted_request_ids=(),
        finished_request_ids=(),
    )  # fmt: skip


def _batch(device: torch.device) -> InputBatch:
    return InputBatch(max_num_tokens=64, max_num_seqs=8, max_model_len=1024, num_groups=2,
                      device=device)  # fmt: skip


def test_the_captured_sizes_stop_at_the_setting_and_the_budget() -> None:
    assert piece_sizes(0, 8192) == ()
    assert piece_sizes(1024, 8192)[-1] == 1024
    assert piece_sizes(1024, 300)[-1] == 256
    assert piece_sizes(100, 8192) == (16, 32, 64)
    with pytest.raises(ValueError, match="piecewise_max_tokens"):
        EngineConfig(piecewise_max_tokens=-1)


def test_a_step_padded_at_its_end_keeps_its_own_metadata() -> None:
    batch = _batch(torch.device("cpu"))
    step = _mixed_step()
    inputs = batch.prepare(step, pad_rows=32)
    assert inputs.input_ids.shape == (32,) and int(inputs.valid_rows[0]) == 16
    for slots in inputs.metadata.slot_mapping:
        assert (slots[16:] == -1).all() and (slots[:16] >= 0).all()
    assert (inputs.metadata.positions[16:] == 0).all()
    assert inputs.metadata.num_decodes == 2
    assert inputs.metadata.prefill_query_start_loc.tolist() == [0, 9, 14]
    assert inputs.logits_indices.tolist() == [0, 1, 10, 15]
    with pytest.raises(ValueError, match="cannot pad"):
        batch.prepare(step, pad_rows=8)
    with pytest.raises(ValueError, match="cannot pad"):
        batch.prepare(step, pad_rows=128)  # past the buffers' rows


def test_the_pieces_give_the_real_rows_the_whole_forward_passes_logits() -> None:
    config, weights, kv = tiny_model(512)
    valid_counts = []

    def moe(x: torch.Tensor, layer_weights, **kwargs) -> torch.Tensor:
        valid_counts.append((x.shape[0], int(kwargs["valid_rows"][0])))
        return mxfp4_moe_reference(x, layer_weights, **kwargs)

    ops = dataclasses.replace(REFERENCE_OPS, moe=moe)
    step = _mixed_step()
    plain_inputs = _batch(torch.device("cpu")).prepare(step)
    plain = forward(weights, kv, ops, plain_inputs.input_ids, plain_inputs.metadata,
                    logits_indices=plain_inputs.logits_indices,
                    valid_rows=plain_inputs.valid_rows)  # fmt: skip
    valid_counts.clear()

    pieces = PiecewiseGraphs((16, 32), weights, kv, ops)
    inputs = _batch(torch.device("cpu")).prepare(step, pad_rows=32)

    def attend_layer(index: int, q: torch.Tensor, out: torch.Tensor) -> None:
        attend(weights, kv, ops, index, q, inputs.metadata, out)

    x, residual = pieces.run_eagerly(32, step.num_tokens, inputs, attend_layer)
    assert valid_counts == [(32, 16)] * config.num_hidden_layers
    logits = final_logits(weights, ops, x, residual, inputs.logits_indices)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_graphs_replay_what_the_pieces_compute_eagerly() -> None:
    pytest.importorskip("triton")
    device = torch.device("cuda")
    _, weights, kv = tiny_model(
        512, device=device, dtype=torch.bfloat16, hidden=512, intermediate=256, experts=4,
        experts_per_token=4, heads=16, kv_heads=4, head_dim=64, layers=4,
    )  # fmt: skip
    batch = _batch(device)
    pieces = PiecewiseGraphs((16, 32), weights, kv, KERNEL_OPS)
    empty = SchedulerOutput(step=-1, scheduled=(), num_decodes=0, preempted_request_ids=(),
                            finished_request_ids=())  # fmt: skip
    pieces.capture(lambda size: batch.prepare(empty, pad_rows=size))
    step = _mixed_step()
    results = []
    for replay in (True, False, True):
        inputs = batch.prepare(step, pad_rows=32)

        def attend_layer(index: int, q: torch.Tensor, out: torch.Tensor, inputs=inputs) -> None:
            attend(weights, kv, KERNEL_OPS, index, q, inputs.metadata, out)

        if replay:
            x, residual = pieces.run(32, step.num_tokens, inputs, attend_layer)
        else:
            x, residual = pieces.run_eagerly(32, step.num_tokens, inputs, attend_layer)
        logits = final_logits(weights, KERNEL_OPS, x, residual, inputs.logits_indices)
        results.append(logits.clone())
    assert torch.isfinite(results[0]).all()
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert pieces.padded_size(16) == 16 and pieces.padded_size(17) == 32
    assert pieces.padded_size(33) is None


class _EagerPieces(PiecewiseGraphs):
    """The pieces launched eagerly where a GPU replays their graphs: the runner's wiring
    (padding, the attention between pieces, the logits after them) on the CPU."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.runs: list[tuple[int, int]] = []

    def padded_size(self, num_tokens: int) -> int | None:
        return smallest_holding(self.sizes, num_tokens)  # captured or not

    def run(self, size, num_tokens, inputs, attend):
        self.runs.append((size, num_tokens))
        return self.run_eagerly(size, num_tokens, inputs, attend)


def test_the_runner_takes_the_pieces_for_steps_that_fit_them() -> None:
    _, weights, kv = tiny_model(512)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    runner = ModelRunner(weights, kv, scheduler, ops=REFERENCE_OPS, use_cuda_graphs=False)
    assert runner.pieces is None  # no graphs on a CPU
    step = _mixed_step()
    eager, _ = runner.forward(step)
    runner.pieces = _EagerPieces((16, 32), weights, kv, REFERENCE_OPS)
    pieced, inputs = runner.forward(step)
    assert runner.pieces.runs == [(16, 16)]
    assert inputs.sampled_request_ids == ("r0", "r1", "r2", "r3")
    torch.testing.assert_close(pieced, eager, rtol=1e-5, atol=1e-5)
    runner.forward(_mixed_step(new_prompt=30))  # 41 rows: past the largest size, eager
    assert runner.pieces.runs == [(16, 16)]
    shorter = dataclasses.replace(step, scheduled=step.scheduled[:3])  # 11 rows, padded to 16
    pieced, _ = runner.forward(shorter)
    assert runner.pieces.runs[-1] == (16, 11)
    runner.pieces = None
    torch.testing.assert_close(pieced, runner.forward(shorter)[0], rtol=1e-5, atol=1e-5)
