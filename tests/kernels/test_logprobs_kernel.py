"""token_logprobs: the Triton kernels against the torch reference (interpreter on CPU with
small chunks and a ragged last chunk; V = 201088 on the GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gptoss_serve.kernels.sampling import token_logprobs, token_logprobs_reference

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
not_interpreted = pytest.mark.skipif(INTERPRETING, reason="real shapes: too slow to interpret")


def _case(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator, device=device) * 4).to(dtype)
    tokens = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    return logits, tokens


def _check(actual, expected, exact_ids: bool = True) -> None:
    chosen, values, ids = actual
    torch.testing.assert_close(chosen, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected[1], rtol=1e-5, atol=1e-5)
    if exact_ids:
        assert torch.equal(ids, expected[2])
    else:  # ties (bf16): any order of equal values, each id once
        assert all(len(set(row)) == len(row) for row in ids.tolist())


@interpreter
@pytest.mark.parametrize("k", [0, 1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_interpreted(k: int, dtype: torch.dtype) -> None:
    from gptoss_serve.kernels._logprobs import token_logprobs_triton  # noqa: PLC0415

    logits, tokens = _case(5, 1000, dtype, "cpu", seed=k)  # 16 chunks of 64, the last of 40
    exact = dtype == torch.float32  # bf16 logits tie: torch.topk orders ties its own way
    expected = token_logprobs_reference(logits, tokens, k)
    _check(token_logprobs_triton(logits, tokens, k, chunk=64), expected, exact)
    rows = torch.tensor([4, 0, 2])  # picked rows, out of order
    expected = token_logprobs_reference(logits, tokens[rows], k, rows=rows)
    _check(token_logprobs_triton(logits, tokens[rows], k, rows, chunk=64), expected, exact)


@interpreter
def test_kernel_ties_go_to_the_lowest_id() -> None:
    from gptoss_serve.kernels._logprobs import token_logprobs_triton  # noqa: PLC0415

    logits = torch.zeros(1, 300)
    logits[0, [250, 7, 130, 64]] = 2.0  # equal, across chunks of 64 and inside one
    chosen, values, ids = token_logprobs_triton(logits, torch.tensor([130]), 6, chunk=64)
    assert ids[0].tolist() == [7, 64, 130, 250, 0, 1]
    expected = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(values[0], expected[ids[0]])
    torch.testing.assert_close(chosen, expected[[130]])


@pytest.mark.gpu
@not_interpreted
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rows", "k"), [(1, 0), (1, 20), (7, 5), (64, 20), (300, 3)])
def test_gpu_matches_the_reference(rows: int, k: int) -> None:
    logits, tokens = _case(rows, 201088, torch.float32, "cuda", seed=rows + k)
    _check(token_logprobs(logits, tokens, k), token_logprobs_reference(logits, tokens, k))
    picked = torch.arange(rows - 1, -1, -2, device="cuda")
    _check(
        token_logprobs(logits, tokens[picked], k, rows=picked),
        token_logprobs_reference(logits, tokens[picked], k, rows=picked),
    )
