"""The random checkpoints must exercise what a bug could hide in: clamps, window, sinks."""

from pathlib import Path

import pytest
import torch

from gptoss_serve.kernels import moe as moe_kernels
from gptoss_serve.model import load_model


def test_swiglu_clamps_bind(checkpoint_dirs: dict[str, Path], monkeypatch) -> None:
    model = load_model(checkpoint_dirs["tiny8"])
    seen = []
    original = moe_kernels.swiglu

    def spy(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
        seen.append(gate_up.clone())
        return original(gate_up, alpha=alpha, limit=limit)

    monkeypatch.setattr("gptoss_serve.kernels.moe.swiglu", spy)
    ids = torch.randint(0, 1024, (200,), generator=torch.Generator().manual_seed(0))
    model(ids, model.new_cache())
    gate_up = torch.cat([t.flatten(0, -2) for t in seen])
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    assert 0.01 < (gate > 7).float().mean() < 0.3
    assert 0.01 < (up.abs() > 7).float().mean() < 0.4


@pytest.mark.parametrize("knob", ["window", "sinks"])
def test_window_and_sinks_change_the_output(checkpoint_dirs: dict[str, Path], knob: str) -> None:
    model = load_model(checkpoint_dirs["tiny8"])
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(1))
    before = model(ids, model.new_cache())
    for layer in model.model.layers:
        if knob == "window":
            layer.self_attn.window = None
        else:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that never attracts attention
    after = model(ids, model.new_cache())
    window = model.config.sliding_window
    if knob == "window":  # nothing changes while every query still fits in the window
        assert torch.equal(before[:window], after[:window])
        assert (before[window:] - after[window:]).abs().max() > 0.1
    else:
        assert (before - after).abs().max() > 0.1
