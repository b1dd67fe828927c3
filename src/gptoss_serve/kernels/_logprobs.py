"""Triton body of ``sampling.token_logprobs`` on CUDA: two launches, no sort, no host sync.

torch's log-softmax and top-k of a 201,088-token row run on few SMs (a row's reduction is one
block): 105 us at batch 1 for the normaliser and the drawn token's value, 294 us with a top 5,
on the H200 (bench/logprobs_cost.py). Here each row is cut into ``CHUNK``-token chunks, as the
sampler's are (_sampling.py), one program a (row, chunk):

1. chunk: the chunk's max logit, sum(exp(l - max)), and its k largest logits with their ids
   (k rounds of argmax, each taken out; ties to the lowest id), as partials.
2. combine, one program a row: log Z = M + log(sum over chunks of sum_c · exp(max_c - M)),
   the drawn token's logit - log Z, and the k largest of the chunks' candidates (in chunk
   order, so ties again go to the lowest id) - log Z.
"""

# Triton kernels: constexpr parameters are UPPER_CASE and launch arguments are positional.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.sampling import LOGPROB_BUCKETS

CHUNK = 1024  # tokens a program: 197 programs a row at V = 201088
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# k is not specialised (0 and 16 would be "divisible by 16", 1 a constant): one compiled
# variant a ROUNDS bucket, which the engine's warm-up compiles (startup.warm_up).
@triton.jit(do_not_specialize=["k"])
def _logprob_chunk_kernel(
    logits_ptr, stride_row, rows_ptr, part_max_ptr, part_sum_ptr, part_value_ptr, part_id_ptr,
    vocab, num_chunks, k, CHUNK: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    index, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + index)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + ids, mask=ids < vocab, other=-float("inf"))
    x = x.to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    total = tl.sum(tl.exp2((x - chunk_max) * LOG2E), axis=0)
    part = index * num_chunks + chunk
    tl.store(part_max_ptr + part, chunk_max)
    tl.store(part_sum_ptr + part, total)
    for j in tl.static_range(ROUNDS):  # k of them stored
        best = tl.argmax(x, 0, tie_break_left=True)
        value = tl.max(x, axis=0)
        tl.store(part_value_ptr + part * k + j, value, mask=j < k)
        tl.store(part_id_ptr + part * k + j, chunk * CHUNK + best, mask=j < k)
        x = tl.where(tl.arange(0, CHUNK) == best, -float("inf"), x)


@triton.jit(do_not_specialize=["k"])
def _logprob_combine_kernel(
    logits_ptr, stride_row, rows_ptr, tokens_ptr, part_max_ptr, part_sum_ptr, part_value_ptr,
    part_id_ptr, chosen_ptr, top_value_ptr, top_id_ptr, num_chunks, k,
    CHUNKS_BLOCK: tl.constexpr, CANDIDATES_BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    index = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    base = index * num_chunks
    chunk_max = tl.load(part_max_ptr + base + chunks, mask=mask, other=-float("inf"))
    chunk_sum = tl.load(part_sum_ptr + base + chunks, mask=mask, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    weights = tl.where(mask, tl.exp2((chunk_max - row_max) * LOG2E), 0.0)
    log_z = row_max + tl.log2(tl.sum(chunk_sum * weights, axis=0)) * LN2
    row = tl.load(rows_ptr + index)
    token = tl.load(tokens_ptr + index)
    drawn = tl.load(logits_ptr + row * stride_row + token).to(tl.float32)
    tl.store(chosen_ptr + index, drawn - log_z)
    if ROUNDS > 0:
        candidates = tl.arange(0, CANDIDATES_BLOCK)
        valid = candidates < num_chunks * k
        values = tl.load(part_value_ptr + base * k + candidates, mask=valid, other=-float("inf"))
        for j in tl.static_range(ROUNDS):  # k of them stored
            best = tl.argmax(values, 0, tie_break_left=True)
            top_id = tl.load(part_id_ptr + base * k + best, mask=j < k)
            tl.store(top_value_ptr + index * k + j, tl.max(values, axis=0) - log_z, mask=j < k)
            tl.store(top_id_ptr + index * k + j, top_id, mask=j < k)
            values = tl.where(candidates == best, -float("inf"), values)


def _rounds(k: int) -> int:
    """The argmax rounds compiled for k alternatives: the smallest of ``LOGPROB_BUCKETS`` that
    holds k, so that at most 7 variants of each kernel are ever compiled."""
    return next(bucket for bucket in LOGPROB_BUCKETS if bucket >= k)


def token_logprobs_triton(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None,
    *, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Same contract as ``sampling.token_logprobs`` (arguments checked there). ``chunk`` (a
    power of two) is a parameter only so that interpreter tests can use several chunks."""
    num_rows = tokens.shape[0]
    vocab = logits.shape[1]
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if rows is None:
        rows = torch.arange(num_rows, dtype=torch.int64, device=device)
    rows, tokens = rows.long().contiguous(), tokens.long().contiguous()
    num_chunks = triton.cdiv(vocab, chunk)
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)
    top_values = torch.empty((num_rows, k), dtype=torch.float32, device=device)
    top_ids = torch.empty((num_rows, k), dtype=torch.int64, device=device)
    if num_rows == 0:
        return chosen, top_values, top_ids
    part_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_value = torch.empty((num_rows, num_chunks, max(k, 1)), dtype=torch.float32, device=device)
    part_id = torch.empty(part_value.shape, dtype=torch.int64, device=device)
    rounds = _rounds(k)
    launcher(_logprob_chunk_kernel)[(num_rows, num_chunks)](
        logits, logits.stride(0), rows, part_max, part_sum, part_value, part_id, vocab,
        num_chunks, k, CHUNK=chunk, ROUNDS=rounds,
    )  # fmt: skip
    launcher(_logprob_combine_kernel)[(num_rows,)](
        logits, logits.stride(0), rows, tokens, part_max, part_sum, part_value, part_id, chosen,
        top_values, top_ids, num_chunks, k, CHUNKS_BLOCK=triton.next_power_of_2(num_chunks),
        CANDIDATES_BLOCK=triton.next_power_of_2(num_chunks * max(rounds, 1)), ROUNDS=rounds,
    )  # fmt: skip
    return chosen, top_values, top_ids
