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
