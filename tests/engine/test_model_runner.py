"""The model runner's host-side helpers on the CPU."""

from __future__ import annotations

import torch

from gptoss_serve.engine.model_runner import SamplingBatch, sampling_tensors


def test_sampling_tensors_carry_each_rows_parameters_in_their_dtypes() -> None:
    """One packed buffer, four views: each row's temperature and top-p as float32 (rounded as
    torch.tensor rounds them), its seed and step as int64, large seeds included."""
    batch = SamplingBatch(
        temperature=[0.0, 0.7, 1.3], top_p=[1.0, 0.9, 0.123456789],
        seeds=[0, 2**63 - 1, 12345], steps=[0, 17, 4096],
    )  # fmt: skip
    temperature, top_p, seeds, steps = sampling_tensors(batch, torch.device("cpu"))
    assert temperature.dtype == top_p.dtype == torch.float32
    assert seeds.dtype == steps.dtype == torch.int64
    assert torch.equal(temperature, torch.tensor(batch.temperature, dtype=torch.float32))
    assert torch.equal(top_p, torch.tensor(batch.top_p, dtype=torch.float32))
    assert seeds.tolist() == batch.seeds and steps.tolist() == batch.steps
    assert all(t.is_contiguous() and t.shape == (3,) for t in (temperature, top_p, seeds, steps))


def test_a_single_row_packs_the_same_way() -> None:
    temperature, top_p, seeds, steps = sampling_tensors(
        SamplingBatch([1.0], [0.5], [7], [3]), torch.device("cpu")
    )
    assert (temperature.tolist(), top_p.tolist(), seeds.tolist(), steps.tolist()) == (
        [1.0], [0.5], [7], [3])  # fmt: skip
