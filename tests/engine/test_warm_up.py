"""The start-up warm-up's steps are ones the runner accepts, at any scheduler limits.

On CUDA the warm-up runs before serving (startup.build_engine); a step it builds that the
runner refuses would stop the server from starting, so its shapes are checked here on the
CPU, with the reference ops, at limits where the batch sizes meet max_num_seqs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine import startup
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.weights import load_weights


@pytest.mark.parametrize(("max_num_seqs", "budget"), [(4, 48), (16, 64), (64, 96), (64, 32)])
def test_every_warm_up_step_runs(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, max_num_seqs: int,
    budget: int,
) -> None:  # fmt: skip
    weights = load_weights(checkpoint_dirs["tiny8"], device="cpu", dtype=torch.float32,
                           progress=False)  # fmt: skip
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=1024),
        kv_cache_tokens=2048, reference_ops=True, use_cuda_graphs=False,
    )  # fmt: skip
    _, runner, plan = build_engine(weights, config)
    steps = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda output: steps.append(output) or forward(output))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a CPU runner
    startup.warm_up(runner, config.scheduler, plan)
    assert steps  # prefills of every size bucket, decodes beside a prefill chunk
    assert max(len(step.scheduled) for step in steps) <= max_num_seqs
    assert any(step.num_decodes for step in steps)
    assert max(step.num_tokens for step in steps) == budget


def test_mixed_shapes_leave_room_for_the_prefill() -> None:
    # The server's defaults: every decode-attention tile row (<= 16, <= 32, more) meets every
    # context from 64 to 64k, and no step holds more than max_num_seqs requests.
    shapes = startup.warm_up_mixed_shapes(SchedulerConfig(max_num_seqs=64))
    assert {batch for batch, _ in shapes} == {1, 4, 16, 32, 63}
    assert {context for _, context in shapes} == {1 << i for i in range(6, 17)}
    # A step of one request, or a budget that holds only the chunk: no mixed steps at all.
    assert startup.warm_up_mixed_shapes(SchedulerConfig(max_num_seqs=1)) == []
    tight = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=20, max_model_len=1024)
    assert {batch for batch, _ in startup.warm_up_mixed_shapes(tight)} == {1, 4}
    assert max(context for _, context in startup.warm_up_mixed_shapes(tight)) == 512


def test_prefill_sizes_meet_the_halfway_rows() -> None:
    sizes = startup.warm_up_prefill_sizes(8192)
    assert {16, 24, 256, 384, 1024, 1536, 6144, 8192} <= set(sizes)
    assert max(sizes) == 8192 and sizes == sorted(set(sizes))
    assert startup.warm_up_prefill_sizes(100) == [*range(1, 17), 24, 32, 48, 64, 96, 100]
    assert startup.warm_up_prefill_sizes(8) == list(range(1, 9))
