"""sample_tokens: the reference's semantics (CPU), the Triton kernels against the reference
token for token (interpreter on CPU, V = 201088 on the GPU), and the GPU draws' statistics,
nucleus membership, batch independence and CUDA-graph capture."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gptoss_serve.kernels.sampling import (
    needs_nucleus,
    nucleus_mask,
    philox_uniform,
    sample_tokens,
    sample_tokens_reference,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
not_interpreted = pytest.mark.skipif(INTERPRETING, reason="real shapes: too slow to interpret")
VOCAB = 201088


def _params(rows: int, device: str, **fixed: float):
    """Random per-row temperature (greedy rows 3, 7, ...), top_p (1 in rows 1, 5, ...), seeds
    and steps; a keyword fixes temperature or top_p in every row."""
    temperature = torch.rand(rows, device=device) * 1.5 + 0.2
    temperature[3::4] = 0.0
    top_p = torch.rand(rows, device=device) * 0.9 + 0.1
    top_p[1::4] = 1.0
    if "temperature" in fixed:
        temperature.fill_(fixed["temperature"])
    if "top_p" in fixed:
        top_p.fill_(fixed["top_p"])
    seeds = torch.randint(-(2**62), 2**62, (rows,), device=device)
    steps = torch.randint(0, 2**20, (rows,), device=device)
    return temperature, top_p, seeds, steps


def _nucleus_ids(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [V] -> the ascending ids of its nucleus."""
    one = torch.ones(1, device=logits.device)
    return nucleus_mask(logits[None], one * temperature, one * top_p)[0].nonzero().flatten()


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor, bins: torch.Tensor) -> float:
    """Pearson's statistic of the draws over ``bins`` plus one bin for every other token."""
    observed = (tokens[:, None] == bins[None, :]).sum(0).double()
    observed = torch.cat((observed, (tokens.numel() - observed.sum())[None]))
    expected = torch.cat((probs[bins], (1 - probs[bins].sum())[None])).double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# --- The reference (CPU) ------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    temperature, top_p, seeds, steps = _params(2, "cpu", temperature=0.0)
    assert sample_tokens_reference(logits, temperature, top_p, seeds, steps).tolist() == [1, 0]
    assert sample_tokens(logits, temperature, top_p, seeds, steps).tolist() == [1, 0]


def test_nucleus_is_the_fewest_tokens_reaching_top_p_with_ties() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert _nucleus_ids(logits, 1.0, 0.75).tolist() == [0, 1]
    assert _nucleus_ids(logits, 1.0, 0.85).tolist() == [0, 1, 2]
    assert _nucleus_ids(logits, 1.0, 0.4).tolist() == [0]
    assert _nucleus_ids(logits, 1.0, 1.0).tolist() == [0, 1, 2, 3]
    assert _nucleus_ids(torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), 1.0, 0.5).tolist() == [0, 1, 2, 3]
    # The same set as ``sample``'s sorted-prefix rule, on distinct random logits.
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 2
    for temperature, top_p in [(1.0, 0.9), (0.5, 0.3), (2.0, 0.99)]:
        probs = torch.softmax(logits / temperature, -1)
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, -1) - sorted_probs
        expected = sorted(order[before < top_p].tolist())
        assert _nucleus_ids(logits, temperature, top_p).tolist() == expected


def test_without_the_nucleus_every_row_keeps_all_its_tokens() -> None:
    logits = _logits(8, 300, torch.float32, "cpu", pad=0)
    params = _params(8, "cpu", top_p=1.0)
    full = sample_tokens_reference(logits, *params)
    assert torch.equal(sample_tokens_reference(logits, *params, nucleus=False), full)
    assert torch.equal(sample_tokens(logits, *params, nucleus=False), full)
    assert not needs_nucleus([1.0, 0.0, 0.7], [1.0, 0.5, 1.0])  # the greedy row's top_p: moot
    assert needs_nucleus([1.0, 0.7], [1.0, 0.9])


def test_philox_uniform_is_uniform_and_keyed_by_seed_and_step() -> None:
    ids = torch.arange(20000)

    def uniform(seed: int, step: int, token_ids: torch.Tensor = ids) -> torch.Tensor:
        return philox_uniform(torch.tensor(seed), torch.tensor(step), token_ids)

    u = uniform(7, 3)
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert torch.equal(u, uniform(7, 3))
    assert torch.equal(u[5:9], uniform(7, 3, ids[5:9]))
    for seed, step in [(8, 3), (7, 4), (7 + 2**32, 3), (-7, 3)]:
        assert float((uniform(seed, step) == u).float().mean()) < 0.01


def test_reference_is_reproducible_and_batch_independent() -> None:
    logits = torch.randn(5, 300) * 3
    temperature, top_p, seeds, steps = _params(5, "cpu", temperature=1.0, top_p=0.9)
    tokens = sample_tokens_reference(logits, temperature, top_p, seeds, steps)
    order = torch.tensor([3, 0, 4, 1, 2])
    shuffled = sample_tokens_reference(
        logits[order], temperature[order], top_p[order], seeds[order], steps[order]
    )
    assert torch.equal(shuffled, tokens[order])
    draws = [
        sample_tokens_reference(logits, temperature, top_p, seeds, steps + i) for i in range(8)
    ]
    assert len({tuple(d.tolist()) for d in draws}) > 1


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.8)])
def test_reference_draws_follow_the_nucleus_softmax(temperature: float, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 3000
    tokens = sample_tokens_reference(
        logits.expand(draws, -1),
        torch.full((draws,), temperature),
        torch.full((draws,), top_p),
        torch.arange(draws) * 7919,  # fixed seeds: a deterministic test
        torch.full((draws,), 11),
    )
    kept = _nucleus_ids(logits, temperature, top_p)
    probs = torch.zeros(7).index_put((kept,), torch.softmax(logits[kept] / temperature, 0))
    assert set(tokens.tolist()) <= set(kept.tolist())
    assert _chi_square(tokens, probs, kept[:-1]) < 30  # len(kept) - 1 dof; p < 1e-4


# --- The kernels ---------------------------------------------------------------------------


def _logits(rows: int, vocab: int, dtype: torch.dtype, device: str, pad: int = 0) -> torch.Tensor:
    """[rows, vocab] logits as a view of a buffer whose padding is +inf: a stray read would win
    every argmax and sample an id past the vocabulary."""
    buffer = torch.full((rows, vocab + pad), float("inf"), dtype=dtype, device=device)
    buffer[:, :vocab] = torch.randn(rows, vocab, device=device) * 3
    return buffer[:, :vocab]


@interpreter
def test_kernel_philox_is_the_reference_philox() -> None:
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    @triton.jit
    def uniform_kernel(out_ptr, seed, step, n, BLOCK: tl.constexpr):  # noqa: N803
        ids = tl.arange(0, BLOCK)
        u = tl.rand(seed, (step.to(tl.int64) << 32) + ids.to(tl.int64))
        tl.store(out_ptr + ids, u, mask=ids < n)

    for seed, step in [(0, 0), (123456789012, 7), (-5, 2**31 - 1), (2**62 + 3, 100)]:
        out = torch.empty(1000)
        uniform_kernel[(1,)](out, seed, step, 1000, BLOCK=1024)
        expected = philox_uniform(torch.tensor(seed), torch.tensor(step), torch.arange(1000))
        assert torch.equal(out, expected)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [512, 4096])
def test_kernel_interpreted(dtype: torch.dtype, chunk: int) -> None:
    sample_tokens_triton = pytest.importorskip(
        "gptoss_serve.kernels._sampling"
    ).sample_tokens_triton
    logits = _logits(6, 1000, dtype, "cpu", pad=24)
    logits[3, 700] = logits[3, 900] = 50.0  # greedy tie across chunks: the lowest id wins
    logits[:2, :512] = -float("inf")  # masked tokens: a whole chunk of them in rows 0 and 1
    logits[:, 3::7] = -float("inf")
    params = _params(6, "cpu")
    expected = sample_tokens_reference(logits, *params)
    assert expected[3] == 700
    assert torch.equal(sample_tokens_triton(logits, *params, chunk=chunk), expected)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_interpreted_without_the_nucleus_search(dtype: torch.dtype) -> None:
    """nucleus=False (no row samples with top_p < 1): the search is skipped, same tokens."""
    sample_tokens_triton = pytest.importorskip(
        "gptoss_serve.kernels._sampling"
    ).sample_tokens_triton
    logits = _logits(6, 1000, dtype, "cpu", pad=24)
    params = _params(6, "cpu", top_p=1.0)
    expected = sample_tokens_reference(logits, *params)
    assert torch.equal(sample_tokens_triton(logits, *params, nucleus=False, chunk=512), expected)


@interpreter
def test_kernel_keeps_the_boundary_token_and_its_ties() -> None:
    sample_tokens_triton = pytest.importorskip(
        "gptoss_serve.kernels._sampling"
    ).sample_tokens_triton
    row = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    # p(600) ~ 0.45, p(100) = p(900) ~ 0.27: top_p 0.6 ends inside the tie, which is kept whole.
    row[600], row[100], row[900] = 12.0, 11.5, 11.5
    draws = 8
    logits = row.to(torch.bfloat16).expand(draws, -1)  # row stride 0: one row read 8 times
    # One request's first eight steps (seed 0).
    params = (torch.ones(draws), torch.full((draws,), 0.6), torch.zeros(draws), torch.arange(draws))
    expected = sample_tokens_reference(logits, *params)
    assert set(expected.tolist()) == {100, 600, 900}
    assert torch.equal(sample_tokens_triton(logits, *params, chunk=512), expected)


# --- The GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@not_interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32])
def test_gpu_matches_the_reference(rows: int, dtype: torch.dtype) -> None:
    logits = _logits(rows, VOCAB, dtype, "cuda", pad=64)
    params = _params(rows, "cuda")
    greedy = sample_tokens(logits, torch.zeros_like(params[0]), *params[1:])
    assert torch.equal(greedy, logits.float().argmax(-1))
    # Same Philox numbers, same nucleus: the same tokens (barring a float near-tie).
    assert torch.equal(sample_tokens(logits, *params), sample_tokens_reference(logits, *params))
    # Every row top_p = 1: the caller may skip the nucleus search (3 launches, not 11).
    whole = _params(rows, "cuda", top_p=1.0)
    expected = sample_tokens_reference(logits, *whole)
    assert torch.equal(sample_tokens(logits, *whole, nucleus=False), expected)
    assert torch.equal(sample_tokens(logits, *whole), expected)


@pytest.mark.gpu
@not_interpreted
def test_gpu_full_softmax_frequencies() -> None:
    """top_p = 1, temperature 1: eight boosted tokens hold most of the mass; their frequencies
    (and the rest's) over 4096 seeds follow the softmax."""
    row = torch.randn(VOCAB, device="cuda")
    boosted = torch.randperm(VOCAB, device="cuda")[:8]
    row[boosted] = 13.0 + torch.arange(8, device="cuda") * 0.25
    logits = row.to(torch.bfloat16).expand(4096, -1)
    tokens = sample_tokens(logits, *_params(4096, "cuda", temperature=1.0, top_p=1.0))
    probs = torch.softmax(logits[0].double(), 0)
    assert _chi_square(tokens, probs, boosted) < 40  # 8 dof: p < 1e-5


@pytest.mark.gpu
@not_interpreted
def test_gpu_never_samples_outside_the_nucleus() -> None:
    row = torch.randn(VOCAB, device="cuda") * 2
    row[:30] += 10.0  # a nucleus of a few dozen tokens
    logits = row.expand(2048, -1)
    params = _params(2048, "cuda", temperature=0.8, top_p=0.7)
    tokens = sample_tokens(logits, *params)
    kept = _nucleus_ids(row, 0.8, 0.7)
    assert torch.isin(tokens, kept).all()
    # Every nucleus token expected at least 20 times shows up (a miss has p < 1e-8 each).
    expected = torch.softmax(row[kept] / 0.8, 0) * tokens.numel()
    assert torch.isin(kept[expected >= 20], tokens).all()


@pytest.mark.gpu
@not_interpreted
def test_gpu_same_seed_and_step_same_token_in_any_batch() -> None:
    logits = _logits(32, VOCAB, torch.bfloat16, "cuda")
    params = _params(32, "cuda", temperature=1.0, top_p=0.95)
    logits[17] = logits[0]
    for values in params:
        values[17] = values[0]
    tokens = sample_tokens(logits, *params)
    alone = sample_tokens(logits[:1], *(values[:1] for values in params))
    assert tokens[17] == tokens[0] == alone[0]


@pytest.mark.gpu
@not_interpreted
def test_gpu_no_host_sync_and_cuda_graph_replay() -> None:
    logits = _logits(32, VOCAB, torch.bfloat16, "cuda")
    params = _params(32, "cuda")
    expected = sample_tokens(logits, *params)  # also compiles every kernel before capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample_tokens(logits, *params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_tokens(logits, *params)
    graph.replay()
    assert torch.equal(captured, expected)
    params[3].add_(1)  # the next step, in place
    graph.replay()
    assert torch.equal(captured, sample_tokens(logits, *params))
