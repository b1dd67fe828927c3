import pytest
import torch

from gptoss_serve.kernels.sampling import sample
from gptoss_serve.model.generate import SamplingParams


def _draws(logits: torch.Tensor, n: int, **kwargs) -> list[int]:
    generator = torch.Generator().manual_seed(kwargs.pop("seed", 0))
    return [sample(logits, generator=generator, **kwargs) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, temperature=0.0, top_p=1.0, generator=None) == 1


def test_top_p_keeps_only_the_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}; 0.85 keeps {0, 1, 2}.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(_draws(logits, 400, temperature=1.0, top_p=0.75)) == {0, 1}
    assert set(_draws(logits, 400, temperature=1.0, top_p=0.85)) == {0, 1, 2}
    assert set(_draws(logits, 400, temperature=1.0, top_p=0.4)) == {0}


def test_temperature_sharpens_and_full_sampling_follows_probabilities() -> None:
    logits = torch.tensor([0.6, 0.4]).log()
    draws = _draws(logits, 4000, temperature=1.0, top_p=1.0)
    assert abs(draws.count(0) / 4000 - 0.6) < 0.03
    cold = _draws(logits, 4000, temperature=0.25, top_p=1.0)  # 0.6^4 : 0.4^4 ~ 0.84 : 0.16
    assert abs(cold.count(0) / 4000 - 0.835) < 0.03


def test_seed_reproducible() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    a = _draws(logits, 50, temperature=1.0, top_p=0.9, seed=7)
    b = _draws(logits, 50, temperature=1.0, top_p=0.9, seed=7)
    c = _draws(logits, 50, temperature=1.0, top_p=0.9, seed=8)
    assert a == b and a != c


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
     dict(top_p=1.5)],
)  # fmt: skip
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
