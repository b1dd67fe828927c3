import pickle

import pytest
import torch

from gptoss_serve.config import SampledToken
from gptoss_serve.kernels.sampling import (
    allowed_tokens,
    apply_token_bitmask,
    sample,
    sample_allowed,
    token_logprobs,
)
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
     dict(top_p=1.5), dict(logprobs=-1), dict(logprobs=21)],
)  # fmt: skip
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def _bitmask(allowed: list[int], vocab_size: int) -> torch.Tensor:
    words = [0] * ((vocab_size + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    # As int32: bit 31 makes a word negative.
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_bitmask_unpacks_to_the_allowed_tokens_including_bit_31() -> None:
    allowed = [0, 5, 31, 32, 63, 64, 99]
    bitmask = _bitmask(allowed, 100)
    assert torch.nonzero(allowed_tokens(bitmask, 100))[:, 0].tolist() == allowed
    logits = torch.zeros(100)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(masked).nonzero()[:, 0].tolist() == allowed
    batch = torch.stack([bitmask, _bitmask([7], 100)])
    assert allowed_tokens(batch, 100).sum(-1).tolist() == [len(allowed), 1]
    with pytest.raises(ValueError, match="bitmask"):
        allowed_tokens(bitmask, 200)  # too few words for the vocabulary


def test_sample_allowed_draws_only_allowed_tokens_with_masked_probabilities() -> None:
    logits = torch.tensor([5.0, 0.0, 1.0, 1.0, 9.0])
    bitmask = _bitmask([1, 2, 3], 5)
    assert sample_allowed(logits, bitmask, temperature=0.0, top_p=1.0, generator=None) == 2
    generator = torch.Generator().manual_seed(0)
    draws = [
        sample_allowed(logits, bitmask, temperature=1.0, top_p=1.0, generator=generator)
        for _ in range(3000)
    ]
    # softmax over {1, 2, 3} with logits 0, 1, 1: 0.155, 0.422, 0.422.
    assert set(draws) == {1, 2, 3}
    assert abs(draws.count(1) / 3000 - 0.155) < 0.03
    with pytest.raises(ValueError, match="no token"):
        sample_allowed(logits, _bitmask([], 5), temperature=1.0, top_p=1.0, generator=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_are_the_log_softmax_in_blocks_of_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(70, 1000, generator=generator) * 4).to(dtype)  # 3 blocks of 32 rows
    tokens = torch.randint(0, 1000, (70,), generator=generator)
    expected = torch.log_softmax(logits.float(), dim=-1)
    chosen, values, ids = token_logprobs(logits, tokens, 5)
    torch.testing.assert_close(chosen, expected.gather(1, tokens[:, None])[:, 0])
    top_values, top_ids = expected.topk(5, dim=-1)
    torch.testing.assert_close(values, top_values)
    assert torch.equal(ids, top_ids)
    # Picked rows, in any order; k = 0; no rows.
    rows = torch.tensor([65, 2, 33])
    chosen, values, ids = token_logprobs(logits, tokens[rows], 0, rows=rows)
    torch.testing.assert_close(chosen, expected[rows].gather(1, tokens[rows, None])[:, 0])
    assert values.shape == ids.shape == (3, 0)
    chosen, values, ids = token_logprobs(logits[:0], tokens[:0], 2)
    assert chosen.shape == (0,) and values.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens[:3], 2)


def test_a_sampled_token_is_an_int_with_its_logprobs() -> None:
    token = SampledToken(7, -0.5, ((7, -0.5), (3, -1.5)))
    assert token == 7 and token in {7} and int(token) == 7 and f"{token}" == "7"
    copy = pickle.loads(pickle.dumps(token))
    assert (copy, copy.logprob, copy.top) == (7, -0.5, ((7, -0.5), (3, -1.5)))
