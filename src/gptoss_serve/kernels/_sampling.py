"""Triton bodies of ``sample_tokens``: greedy / temperature / top-p without a sort or host sync.

Every row is cut into fixed chunks of ``CHUNK`` tokens; each launch runs one program per
(row, chunk) and writes per-chunk partials that the next launch combines, in a fixed order.
The chunking depends only on the vocabulary size, never on the batch, so a row's result does
not depend on which batch it runs in.

1. stats: per chunk, the max logit, its lowest id, and sum(exp((l - max_chunk) / T)).
2. search (top_p < 1): the nucleus is {l >= the k-th largest logit}, k the smallest count whose
   probability mass reaches top_p. With M(t) = mass of {l >= t}, non-increasing in t, that
   threshold is the largest t with M(t) >= top_p · total. We find it by radix select over the
   32-bit order-preserving integer key of the logit, 4 bits a pass: each pass evaluates M at the
   16 candidates prefix + d·2^shift (a [tile, 16] compare and masked sum) and keeps the largest
   d whose mass reaches the target. After 8 passes (4 for bf16/fp16 logits, whose low 16 key
   bits carry nothing) the threshold is exact: a logit's key, ties all kept, so the kept set is
   exactly the nucleus up to float rounding of the masses.
3. sample: Gumbel-max over the kept tokens, argmax of (l - max) / T - log(-log(u)), which is an
   exact draw from the temperature softmax renormalised to the nucleus. u is Philox keyed by the
   request's seed with counter (token id, step): tl.rand(seed, step · 2^32 + token id).
4. finish: per row, the best chunk (greedy: from the stats; sampled: from step 3).

When the caller knows that no row has top_p < 1 (``nucleus=False``), step 2 is not launched:
3 launches instead of 11 for fp32 logits.
"""

# Triton kernels: constexpr parameters are UPPER_CASE and launch arguments are positional.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_serve.kernels.fast_launch import launcher

# Tokens per program: 197 programs a row at V = 201088. Each pass is one short launch, so more,
# smaller programs win: fp32 logits, batch 1 on the H200, all passes 64 us at 1024 against
# 133 us at 4096 and 447 us at 16384 (bench/step_profile.py).
CHUNK = 1024
# Tokens per step of a search program's loop: its [SEARCH_TILE, 16] partial masses stay in
# registers (128: 884 us for the whole sampler at batch 64 on the H100, 256: 968, 512: 1,089;
# batch 1 56 / 51 / 49 us). Fixed, like CHUNK: the sums' order must not depend on the batch.
SEARCH_TILE = 128
RADIX_BITS = tl.constexpr(4)
NUM_DIGITS = tl.constexpr(16)  # 2**RADIX_BITS candidates per search pass
LOG2E = tl.constexpr(1.4426950408889634)
KEY_MIN = tl.constexpr(-(2**31))  # the smallest order key: every token kept


@triton.jit
def _order_key(x):
    """float32 -> int64 whose order is the float order (-0.0 sorts just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _row_stats(part_max_ptr, part_sum_ptr, row, num_chunks, scale, CHUNKS_BLOCK: tl.constexpr):
    """Combines the chunk partials: (row max logit, sum(exp2((l - max) · scale)))."""
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    chunk_max = tl.load(part_max_ptr + row * num_chunks + chunks, mask=mask, other=-float("inf"))
    chunk_sum = tl.load(part_sum_ptr + row * num_chunks + chunks, mask=mask, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    weights = tl.where(mask, tl.exp2((chunk_max - row_max) * scale), 0.0)
    return row_max, tl.sum(chunk_sum * weights, axis=0)


@triton.jit
def _search_prefix(
    prefix_ptr, mass_ptr, row, num_rows, num_chunks, target,
    PASS: tl.constexpr, NUM_PASSES: tl.constexpr, CHUNKS_BLOCK: tl.constexpr,
):  # fmt: skip
    """The threshold prefix that search pass PASS refines (PASS == NUM_PASSES: the threshold)."""
    prefix = tl.full([], KEY_MIN, tl.int64)
    if PASS > 0:
        if PASS > 1:
            prefix = tl.load(prefix_ptr + row * NUM_PASSES + PASS - 1)
        # Masses of the previous pass's 16 candidates, summed over the chunks in a fixed order.
        chunks = tl.arange(0, CHUNKS_BLOCK)[:, None]
        digits = tl.arange(0, NUM_DIGITS)
        base = mass_ptr + (((PASS - 1) % 2) * num_rows + row) * num_chunks * NUM_DIGITS
        masses = tl.load(
            base + chunks * NUM_DIGITS + digits[None, :], mask=chunks < num_chunks, other=0.0
        )
        masses = tl.sum(masses, axis=0)
        # The largest digit whose candidate keeps at least the target mass; digit 0 always
        # qualifies (the previous pass chose it so), even where rounding says otherwise.
        digit = tl.max(tl.where(masses >= target, digits, 0), axis=0)
        prefix += digit.to(tl.int64) << (32 - RADIX_BITS * PASS)
    return prefix


@triton.jit
def _stats_kernel(
    logits_ptr, stride_row, temperature_ptr, part_max_ptr, part_arg_ptr, part_sum_ptr,
    vocab, num_chunks, CHUNK: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    start = chunk * CHUNK
    best = tl.full([], -float("inf"), tl.float32)
    best_id = start
    for i in range(0, CHUNK, TILE):
        ids = start + i + tl.arange(0, TILE)
        x = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        take = tile_max > best  # strict: the earlier tile keeps ties (lowest id)
        best_id = tl.where(take, start + i + tl.argmax(x, 0, tie_break_left=True), best_id)
        best = tl.where(take, tile_max, best)
    temperature = tl.load(temperature_ptr + row)
    total = tl.zeros([], tl.float32)
    if temperature > 0:  # greedy rows need no sum
        scale = LOG2E / temperature
        # best is -inf only in a chunk of -inf logits (masked tokens): clamped, -inf - floor
        # stays -inf and adds exp2(-inf) = 0 where -inf - -inf would add NaN.
        floor = tl.maximum(best, -3.0e38)
        acc = tl.zeros([TILE], tl.float32)
        for i in range(0, CHUNK, TILE):
            ids = start + i + tl.arange(0, TILE)
            x = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
            acc += tl.exp2((x - floor) * scale)
        total = tl.sum(acc, axis=0)
    index = row * num_chunks + chunk
    tl.store(part_max_ptr + index, best)
    tl.store(part_arg_ptr + index, best_id)
    tl.store(part_sum_ptr + index, total)


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_rows"])
def _search_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, part_max_ptr, part_sum_ptr,
    prefix_ptr, mass_ptr, vocab, num_rows, num_chunks,
    PASS: tl.constexpr, NUM_PASSES: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):  # fmt: skip
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    if (temperature > 0) & (top_p < 1):  # other rows keep every token: nothing to search
        scale = LOG2E / temperature
        row_max, total = _row_stats(
            part_max_ptr, part_sum_ptr, row, num_chunks, scale, CHUNKS_BLOCK
        )
        prefix = _search_prefix(
            prefix_ptr, mass_ptr, row, num_rows, num_chunks, top_p * total,
            PASS, NUM_PASSES, CHUNKS_BLOCK,
        )  # fmt: skip
        if PASS > 0:  # noqa: SIM102 (a constexpr branch: compiled away in pass 0)
            if chunk == 0:  # every program computed the same prefix; one keeps it for the next
                tl.store(prefix_ptr + row * NUM_PASSES + PASS, prefix)
        # [NUM_DIGITS] candidate thresholds of this pass
        candidates = prefix + (tl.arange(0, NUM_DIGITS).to(tl.int64) << (28 - RADIX_BITS * PASS))
        # The [TILE, 16] candidate masses add up in registers; one reduction a chunk. (A
        # reduction a tile, with a skip of tiles wholly below the prefix, cost a reduction and
        # a barrier each: H100, the whole sampler at fp32 logits, batch 1 / 8 / 64, 62 / 178 /
        # 1,188 -> 56 / 138 / 884 us.)
        acc = tl.zeros([TILE, NUM_DIGITS], tl.float32)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        for i in range(0, CHUNK, TILE):
            ids = chunk * CHUNK + i + tl.arange(0, TILE)
            x = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
            mass = tl.where(ids < vocab, tl.exp2((x - row_max) * scale), 0.0)
            kept = _order_key(x)[:, None] >= candidates[None, :]  # [TILE, NUM_DIGITS]
            acc += tl.where(kept, mass[:, None], 0.0)
        masses = tl.sum(acc, axis=0)
        out = mass_ptr + ((PASS % 2) * num_rows + row) * num_chunks * NUM_DIGITS
        tl.store(out + chunk * NUM_DIGITS + tl.arange(0, NUM_DIGITS), masses)


@triton.jit(do_not_specialize=["num_rows"])
def _sample_kernel(
    logits_ptr, stride_row, temperature_ptr, top_p_ptr, seeds_ptr, steps_ptr, part_max_ptr,
    part_sum_ptr, prefix_ptr, mass_ptr, part_score_ptr, part_token_ptr, vocab, num_rows,
    num_chunks, NUM_PASSES: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr, NUCLEUS: tl.constexpr,
):  # fmt: skip
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:  # greedy rows are finished from the stats
        top_p = tl.load(top_p_ptr + row)
        scale = LOG2E / temperature
        row_max, total = _row_stats(
            part_max_ptr, part_sum_ptr, row, num_chunks, scale, CHUNKS_BLOCK
        )
        threshold = tl.full([], KEY_MIN, tl.int64)
        if NUCLEUS:  # noqa: SIM102 (constexpr: else no search ran, every token is kept)
            if top_p < 1:
                threshold = _search_prefix(
                    prefix_ptr, mass_ptr, row, num_rows, num_chunks, top_p * total,
                    NUM_PASSES, NUM_PASSES, CHUNKS_BLOCK,
                )  # fmt: skip
        seed = tl.load(seeds_ptr + row)
        counter_high = tl.load(steps_ptr + row).to(tl.int64) << 32
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        start = chunk * CHUNK
        best = tl.full([], -float("inf"), tl.float32)
        best_id = start
        for i in range(0, CHUNK, TILE):
            ids = start + i + tl.arange(0, TILE)
            x = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
            kept = (ids < vocab) & (_order_key(x) >= threshold)
            if tl.max(kept.to(tl.int32), axis=0) > 0:  # Philox only where a token can win
                # Philox(key = seed, counter = (token id, step, 0, 0)) -> u in [0, 1)
                u = tl.rand(seed, counter_high + ids.to(tl.int64))
                score = tl.math.div_rn(x - row_max, temperature) - tl.log(-tl.log(u))
                score = tl.where(kept, score, -float("inf"))
                tile_max = tl.max(score, axis=0)
                take = tile_max > best
                best_id = tl.where(
                    take, start + i + tl.argmax(score, 0, tie_break_left=True), best_id
                )
                best = tl.where(take, tile_max, best)
        tl.store(part_score_ptr + row * num_chunks + chunk, best)
        tl.store(part_token_ptr + row * num_chunks + chunk, best_id)


@triton.jit
def _finish_kernel(
    temperature_ptr, part_max_ptr, part_arg_ptr, part_score_ptr, part_token_ptr, tokens_ptr,
    num_chunks, CHUNKS_BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    mask = chunks < num_chunks
    index = row * num_chunks + chunks
    if tl.load(temperature_ptr + row) > 0:
        score = tl.load(part_score_ptr + index, mask=mask, other=-float("inf"))
        token = tl.load(part_token_ptr + index, mask=mask, other=0)
    else:
        score = tl.load(part_max_ptr + index, mask=mask, other=-float("inf"))
        token = tl.load(part_arg_ptr + index, mask=mask, other=0)
    best = tl.argmax(score, 0, tie_break_left=True)  # the earlier chunk keeps ties
    tl.store(tokens_ptr + row, tl.sum(tl.where(chunks == best, token, 0), axis=0).to(tl.int64))


def sample_tokens_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    nucleus: bool = True,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Launches the four stages (the search only with ``nucleus``); same contract as
    ``sampling.sample_tokens``. ``chunk`` (a power of two) is a parameter only so that
    interpreter tests can use several chunks."""
    num_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, top_p = temperature.float().contiguous(), top_p.float().contiguous()
    seeds, steps = seeds.long().contiguous(), steps.long().contiguous()
    num_chunks = triton.cdiv(vocab, chunk)
    # bf16/fp16 logits widen to float32 keys whose low 16 bits are constant: 4 passes suffice.
    num_passes = (32 if logits.dtype == torch.float32 else 16) // RADIX_BITS.value
    device, shape = logits.device, (num_rows, num_chunks)
    part_max = torch.empty(shape, dtype=torch.float32, device=device)
    part_sum, part_score = torch.empty_like(part_max), torch.empty_like(part_max)
    part_arg = torch.empty(shape, dtype=torch.int32, device=device)
    part_token = torch.empty_like(part_arg)
    masses = torch.empty((2, *shape, NUM_DIGITS.value), dtype=torch.float32, device=device)
    prefixes = torch.empty((num_rows, num_passes), dtype=torch.int64, device=device)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return tokens
    grid = (num_rows, num_chunks)
    sizes = dict(CHUNK=chunk, CHUNKS_BLOCK=triton.next_power_of_2(num_chunks))
    row_stride = logits.stride(0)
    launcher(_stats_kernel)[grid](
        logits, row_stride, temperature, part_max, part_arg, part_sum, vocab, num_chunks,
        CHUNK=chunk, TILE=min(chunk, 1024),
    )  # fmt: skip
    for pass_index in range(num_passes if nucleus else 0):
        launcher(_search_kernel)[grid](
            logits, row_stride, temperature, top_p, part_max, part_sum, prefixes, masses,
            vocab, num_rows, num_chunks, PASS=pass_index, NUM_PASSES=num_passes,
            TILE=min(chunk, SEARCH_TILE), **sizes,
        )  # fmt: skip
    launcher(_sample_kernel)[grid](
        logits, row_stride, temperature, top_p, seeds, steps, part_max, part_sum, prefixes,
        masses, part_score, part_token, vocab, num_rows, num_chunks, NUM_PASSES=num_passes,
        TILE=min(chunk, 1024), NUCLEUS=nucleus, **sizes,
    )  # fmt: skip
    launcher(_finish_kernel)[(num_rows,)](
        temperature, part_max, part_arg, part_score, part_token, tokens, num_chunks,
        CHUNKS_BLOCK=sizes["CHUNKS_BLOCK"],
    )  # fmt: skip
    return tokens
