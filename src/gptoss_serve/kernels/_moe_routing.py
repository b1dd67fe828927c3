"""Triton bodies of the MoE routing: router logits, top-k + softmax, grouping pairs by expert.

A (token, slot) pair ``p = t·top_k + slot`` is one row of the expert GEMMs. Grouping writes

- ``sorted_pair_ids`` [P] int32: the pairs ordered by expert (row r of the GEMMs is pair
  ``sorted_pair_ids[r]``);
- ``block_table`` [3, max_blocks] int32: for every BLOCK_M-row block of the GEMMs, its expert,
  its first row, and the end row of that expert's segment (rows past it are masked);
- ``num_blocks`` [1] int32: how many leading entries of the table are live. The GEMM grids are
  sized by the host-known bound ``max_blocks`` and programs past ``num_blocks`` exit, so nothing
  here needs a device-to-host sync (CUDA-graph safe).

Two grouping paths: a single-program counting sort (decode: up to a few hundred pairs, one
launch, stable order) and a multi-program one with atomics (prefill: histogram, table,
scatter). The order of pairs within one expert does not change any output value (each row is
an independent dot product), so the atomic path is still deterministic.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl

from gptoss_serve.kernels._moe_common import _dot, _num_valid


@triton.jit
def _logits_tile(
    x_ptr, weight_ptr, bias_ptr, tokens, experts, num_tokens, num_experts, stride_x,
    HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """fp32 router logits [len(tokens), len(experts)] = x @ Wr^T + br (bf16 in, fp32 accumulate)."""
    token_mask = tokens < num_tokens
    expert_mask = experts < num_experts
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([tokens.shape[0], experts.shape[0]], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        x_mask = token_mask[:, None]
        w_mask = expert_mask[:, None]
        if HIDDEN % BLOCK_K != 0:
            x_mask = x_mask & (k0 + ks < HIDDEN)[None, :]
            w_mask = w_mask & (k0 + ks < HIDDEN)[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + (k0 + ks)[None, :], mask=x_mask, other=0.0)
        w_ptrs = weight_ptr + experts[:, None] * HIDDEN + (k0 + ks)[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = _dot(x, tl.trans(w), acc, INTERPRET)
    bias = tl.load(bias_ptr + experts, mask=expert_mask, other=0.0).to(tl.float32)
    return acc + bias[None, :]


@triton.jit
def _topk_softmax(logits, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """[BT, E_PAD] fp32 logits (-inf in padding) -> (ids [BT, K_PAD] int32, weights fp32).

    Descending order like torch.topk; exact ties go to the lowest expert id. Slots past TOP_K
    hold garbage the caller masks. weights = softmax over the TOP_K chosen logits.
    """
    E_PAD: tl.constexpr = logits.shape[1]
    experts = tl.arange(0, E_PAD)[None, :]
    slots = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([logits.shape[0], K_PAD], tl.int32)
    values = tl.full([logits.shape[0], K_PAD], float("-inf"), tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(logits, axis=1)
        best_id = tl.min(tl.where(logits == best[:, None], experts, E_PAD), axis=1)
        ids = tl.where(slots == slot, best_id[:, None], ids)
        values = tl.where(slots == slot, best[:, None], values)
        logits = tl.where(experts == best_id[:, None], float("-inf"), logits)
    weights = tl.exp(values - tl.max(values, axis=1)[:, None])  # padding slots: exp(-inf) = 0
    return ids, weights / tl.sum(weights, axis=1)[:, None]


@triton.jit
def _write_routing(
    expert_ids_ptr, routing_weights_ptr, logits, tokens, token_mask,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    """Top-k + softmax of ``logits`` [BT, E_PAD] (-inf in padding), stored for ``tokens``
    [BT] (where ``token_mask``) as expert ids [T, k] int32 and routing weights [T, k] fp32."""
    ids, weights = _topk_softmax(logits, TOP_K, K_PAD)
    slots = tl.arange(0, K_PAD)
    pairs = tokens[:, None] * TOP_K + slots[None, :]
    valid = token_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(expert_ids_ptr + pairs, ids, mask=valid)
    tl.store(routing_weights_ptr + pairs, weights, mask=valid)


@triton.jit
def _router_kernel(
    x_ptr, weight_ptr, bias_ptr, logits_ptr, num_tokens, num_experts, stride_x,
    HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Decode: logits [T, E] fp32, split over experts so that many SMs share the weight read."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    logits = _logits_tile(
        x_ptr, weight_ptr, bias_ptr, tokens, experts, num_tokens, num_experts, stride_x,
        HIDDEN, BLOCK_K, INTERPRET,
    )  # fmt: skip
    mask = (tokens < num_tokens)[:, None] & (experts < num_experts)[None, :]
    tl.store(logits_ptr + tokens[:, None] * num_experts + experts[None, :], logits, mask=mask)


# do_not_specialize: counts that vary by step compile once, not per value class (compile_watch.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _router_topk_kernel(
    x_ptr, weight_ptr, bias_ptr, expert_ids_ptr, routing_weights_ptr,
    num_tokens, num_experts, stride_x, HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Prefill: logits of BLOCK_T tokens over all experts, then top-k + softmax in registers."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    logits = _logits_tile(
        x_ptr, weight_ptr, bias_ptr, tokens, experts, num_tokens, num_experts, stride_x,
        HIDDEN, BLOCK_K, INTERPRET,
    )  # fmt: skip
    logits = tl.where((experts < num_experts)[None, :], logits, float("-inf"))
    _write_routing(
        expert_ids_ptr, routing_weights_ptr, logits, tokens, tokens < num_tokens, TOP_K, K_PAD
    )


@triton.jit
def _write_block_table(
    counts, expert_start, block_table_ptr, num_blocks_ptr, max_blocks,
    BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr,
):  # fmt: skip
    """counts/expert_start [E_PAD] -> block_table rows (expert, row_start, row_end), num_blocks."""
    block_start, block_end = _expert_blocks(counts, BLOCK_M)
    tl.store(num_blocks_ptr, tl.max(block_end, 0))
    b0 = tl.program_id(0) * 0  # a tensor: while, not range (the interpreter needs it)
    while b0 < max_blocks:
        _write_table_chunk(counts, expert_start, block_start, block_end, block_table_ptr,
                           max_blocks, b0, BLOCK_M, CHUNK_B)  # fmt: skip
        b0 += CHUNK_B


@triton.jit
def _expert_blocks(counts, BLOCK_M: tl.constexpr):
    """counts [E_PAD] -> each expert's first block and the block after its last (its blocks
    of up to BLOCK_M rows, experts in order); the last end is the number of blocks."""
    blocks_per_expert = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks_per_expert, 0)
    return block_end - blocks_per_expert, block_end


@triton.jit
def _write_table_chunk(
    counts, expert_start, block_start, block_end, block_table_ptr, max_blocks, b0,
    BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr,
):  # fmt: skip
    """Block table rows [b0, b0 + CHUNK_B) from counts/expert_start and ``_expert_blocks``."""
    experts = tl.arange(0, counts.shape[0])
    blocks = b0 + tl.arange(0, CHUNK_B)
    # Block b belongs to the first expert whose block range ends after b.
    owner = tl.sum((block_end[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
    hit = experts[None, :] == owner[:, None]
    first_block = tl.sum(tl.where(hit, block_start[None, :], 0), axis=1)
    segment_start = tl.sum(tl.where(hit, expert_start[None, :], 0), axis=1)
    segment_end = segment_start + tl.sum(tl.where(hit, counts[None, :], 0), axis=1)
    mask = blocks < max_blocks
    tl.store(block_table_ptr + blocks, owner, mask=mask)
    row_start = segment_start + (blocks - first_block) * BLOCK_M
    tl.store(block_table_ptr + max_blocks + blocks, row_start, mask=mask)
    tl.store(block_table_ptr + 2 * max_blocks + blocks, segment_end, mask=mask)


@triton.jit
def _chunk_pairs(
    logits_ptr, expert_ids_ptr, routing_weights_ptr, t0, num_tokens, num_experts, num_valid,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, CHUNK_T: tl.constexpr,
    FROM_LOGITS: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """The pairs of tokens [t0, t0 + CHUNK_T) flattened: (expert ids, pair ids), [CHUNK_T·K_PAD];
    invalid pairs, and those of padding tokens (``num_valid`` and on, whose routing is still
    stored), get expert E_PAD, which matches no expert. From logits: top-k here (and the
    routing stored if STORE); else the expert ids are read."""
    tokens = t0 + tl.arange(0, CHUNK_T)
    slots = tl.arange(0, K_PAD)
    valid = (tokens < num_tokens)[:, None] & (slots < TOP_K)[None, :]
    pairs = tokens[:, None] * TOP_K + slots[None, :]
    if FROM_LOGITS:
        experts = tl.arange(0, E_PAD)
        mask = (tokens < num_tokens)[:, None] & (experts < num_experts)[None, :]
        logits = tl.load(
            logits_ptr + tokens[:, None] * num_experts + experts[None, :], mask=mask, other=0.0
        )
        logits = tl.where((experts < num_experts)[None, :], logits, float("-inf"))
        ids, weights = _topk_softmax(logits, TOP_K, K_PAD)
        if STORE:
            tl.store(expert_ids_ptr + pairs, ids, mask=valid)
            tl.store(routing_weights_ptr + pairs, weights, mask=valid)
    else:
        ids = tl.load(expert_ids_ptr + pairs, mask=valid, other=0)
    ids = tl.where(valid & (tokens < num_valid)[:, None], ids, E_PAD)
    return tl.reshape(ids, [CHUNK_T * K_PAD]), tl.reshape(pairs, [CHUNK_T * K_PAD])


@triton.jit(do_not_specialize=["num_tokens", "max_blocks"])
def _route_small_kernel(
    logits_ptr, expert_ids_ptr, routing_weights_ptr,
    sorted_pair_ids_ptr, block_table_ptr, num_blocks_ptr,
    num_tokens, num_experts, max_blocks, valid_rows_ptr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, CHUNK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr, FROM_LOGITS: tl.constexpr,
):  # fmt: skip
    """Decode, one program: (top-k +) a stable counting sort of the pairs by expert.

    Pass 1 counts pairs per expert; pass 2 places each pair at its expert's start plus its
    rank among that expert's earlier pairs. Top-k is recomputed in pass 2 rather than read
    back, so no intra-program barrier is needed. Tokens at or past ``valid_rows[0]`` (None:
    none) are routed but not grouped.
    """
    num_valid = _num_valid(valid_rows_ptr, num_tokens)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    t0 = tl.program_id(0) * 0
    while t0 < num_tokens:
        ids, _ = _chunk_pairs(
            logits_ptr, expert_ids_ptr, routing_weights_ptr, t0, num_tokens, num_experts,
            num_valid, TOP_K, K_PAD, E_PAD, CHUNK_T, FROM_LOGITS, True,
        )  # fmt: skip
        counts += tl.histogram(ids, E_PAD, mask=ids < E_PAD)
        t0 += CHUNK_T
    expert_start = tl.cumsum(counts, 0) - counts
    _write_block_table(
        counts, expert_start, block_table_ptr, num_blocks_ptr, max_blocks, BLOCK_M, CHUNK_B
    )
    cursor = expert_start
    t0 = tl.program_id(0) * 0
    while t0 < num_tokens:
        ids, pairs = _chunk_pairs(
            logits_ptr, expert_ids_ptr, routing_weights_ptr, t0, num_tokens, num_experts,
            num_valid, TOP_K, K_PAD, E_PAD, CHUNK_T, FROM_LOGITS, False,
        )  # fmt: skip
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK_T·K_PAD, E_PAD]
        rows = tl.sum(onehot * (tl.cumsum(onehot, 0) - 1 + cursor[None, :]), axis=1)
        tl.store(sorted_pair_ids_ptr + rows, pairs, mask=ids < E_PAD)
        cursor += tl.sum(onehot, axis=0)
        t0 += CHUNK_T


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    expert_ids_ptr, counts_ptr, num_pairs, valid_rows_ptr,
    E_PAD: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """Prefill: counts[e] += pairs of this block routed to e (counts zeroed by the host); the
    pairs of tokens at or past ``valid_rows[0]`` (None: none) are not counted."""
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pairs < _num_valid(valid_rows_ptr, num_pairs, TOP_K)
    ids = tl.load(expert_ids_ptr + pairs, mask=mask, other=E_PAD)
    local = tl.histogram(ids, E_PAD, mask=mask)
    experts = tl.arange(0, E_PAD)
    tl.atomic_add(counts_ptr + experts, local, mask=local > 0, sem="relaxed")


@triton.jit(do_not_specialize=["max_blocks"])
def _block_table_kernel(
    counts_ptr, cursor_ptr, block_table_ptr, num_blocks_ptr, num_experts, max_blocks,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr,
):  # fmt: skip
    """Prefill, one program per CHUNK_B rows of the block table: expert segments from the
    counts (each program sums them itself); program 0 also writes cursor = segment starts and
    num_blocks."""
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    expert_start = tl.cumsum(counts, 0) - counts
    block_start, block_end = _expert_blocks(counts, BLOCK_M)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + experts, expert_start, mask=experts < num_experts)
        tl.store(num_blocks_ptr, tl.max(block_end, 0))
    _write_table_chunk(counts, expert_start, block_start, block_end, block_table_ptr, max_blocks,
                       tl.program_id(0) * CHUNK_B, BLOCK_M, CHUNK_B)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    expert_ids_ptr, cursor_ptr, sorted_ids_ptr, num_pairs, valid_rows_ptr,
    BLOCK: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """Prefill: each pair takes the next free row of its expert's segment (the pairs that
    ``_count_kernel`` counted: not those of padding tokens)."""
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pairs < _num_valid(valid_rows_ptr, num_pairs, TOP_K)
    ids = tl.load(expert_ids_ptr + pairs, mask=mask, other=0)
    rows = tl.atomic_add(cursor_ptr + ids, 1, mask=mask, sem="relaxed")
    tl.store(sorted_ids_ptr + rows, pairs, mask=mask)


@triton.jit
def _topk_debug_kernel(logits_ptr, ids_ptr, weights_ptr, E: tl.constexpr, TOP_K: tl.constexpr):
    """Debug: ``_topk_softmax`` of one row of logits [rows, E] fp32 per program -> ids and
    weights [rows, TOP_K] (tests only)."""
    E_PAD: tl.constexpr = triton.next_power_of_2(E)
    K_PAD: tl.constexpr = triton.next_power_of_2(TOP_K)
    row = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + row * E + experts, mask=experts < E, other=float("-inf"))
    ids, weights = _topk_softmax(logits[None, :], TOP_K, K_PAD)
    slots = tl.arange(0, K_PAD)[None, :]
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
