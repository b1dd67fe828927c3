"""Triton kernels of the decode-path MoE (few tokens): three launches, no host sync.

1. ``_router_kernel``: fp32 router logits [T, E], one program per BLOCK_E experts (the 0.74 MB
   router read spread over the SMs); the programs also write x in thread order (_moe_gemv.py)
   for the GEMVs, and the last one to finish computes the top-k routing of every token (the
   GEMV programs then load 4 ids instead of each running a top-4 over 128 logits, which was
   ~1,000 of a gate_up thread's ~6,000 instructions at T = 1).
2. ``_gate_up_kernel``: one program per (pair p = (token, slot), BN-row tile of the 2I gate/up
   rows). It takes its expert from the routing or from the token's top-k, recomputed from the logits
   (at 1 and 3-4 tokens, 5-8 on an H100, by each warp on its own copy: reductions without barriers),
   streams the expert's rows through the MXFP4 GEMV and applies bias and the clamped SwiGLU; h [P,
   I] bf16 is stored in thread order for the down GEMV. The tile-0 programs write the pair's expert
   id and routing weight.
3. ``_down_kernel``: one program per (token, BR-row tile of H). Its GEMV tile stacks the BR rows
   of each of the token's k experts (k·BR rows), the k activation columns are the pairs' h, and
   row (e, r) keeps column e; bias, routing weight and the sum over the k experts (a fixed
   reduction tree: deterministic) follow in registers, out [T, H] bf16.

PDL (programmatic dependent launch, optional; kernels/launch.py): each of the three waits
(griddepcontrol.wait) before it reads or writes anything, and lets the next kernel launch
only once its own weight stream is done (griddepcontrol.launch_dependents after the GEMV
loop): next kernels' programs launched at the start sit beside the stream and slowed the
T = 1 MoE from 36 to 55 us a layer. The router and down take EARLY (a tile field) where the
step gained from it: then they let the next kernel in at their start. (An earlier variant had
down prefetch its experts' rows into L2 before its wait: 54.8 against 36.4 us a layer at
T = 1.)
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.kernels._moe_columns import _group_pairs, _tile_order_step
from gptoss_serve.kernels._moe_common import _num_valid, _to_bf16
from gptoss_serve.kernels._moe_gemv import (
    ACC_SCALE,
    _mxfp4_gemv,
    _slot_blocks,
    _stored_groups,
    _tile_slots,
)
from gptoss_serve.kernels._moe_routing import _topk_softmax, _write_routing


@triton.jit
def _thread_order(x, BK: tl.constexpr):
    """[R, BK] -> the same values in thread order: in each block of 8, position j holds element
    j with bits 0 and 2 exchanged."""
    x = tl.reshape(x, [x.shape[0], BK // 8, 2, 2, 2])
    return tl.reshape(tl.permute(x, (0, 1, 4, 3, 2)), [x.shape[0], BK])


# do_not_specialize: g_max (the groups' bound, 4 per token) varies with the token count, and its
# value classes would compile the grouping router anew where the token count's do not (as for
# _moe_columns._group_kernel's; engine/compile_watch.py)
@triton.jit(do_not_specialize=["g_max"])
def _router_kernel(
    x_ptr, weight_ptr, bias_ptr, logits_ptr, x_thread_ptr, counter_ptr, expert_ids_ptr,
    routing_weights_ptr, num_tokens, stride_x,
    valid_rows_ptr, group_expert_ptr, group_pairs_ptr, g_max,
    H: tl.constexpr, E: tl.constexpr, T_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, TOP_K: tl.constexpr, ROUTE: tl.constexpr, PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False, TILE_ORDER: tl.constexpr = 0, EARLY: tl.constexpr = False,
    GROUP_COLS: tl.constexpr = 0, GROUP_FILL: tl.constexpr = 1,
):  # fmt: skip
    """logits [T, E] fp32 = x @ Wr^T + br for BLOCK_E experts; x_thread [T, H] bf16 for the
    BLOCK_K chunks c with c % num_programs == program (each chunk written once), in thread
    order, or with TILE_ORDER (_moe_gemv.ORDER_MMA / ORDER_WGMMA) in that tile order, rows
    128·ceil(H / 128) long with the padding past H written as zeros.

    ROUTE: the last program to finish (a ticket from ``counter_ptr``) also writes every
    token's top-k expert ids [T, k] int32 and routing weights [T, k] fp32, once, so that the
    GEMV programs just load them, then re-arms the counter to 0 for the next launch.
    GROUP_COLS (> 0, with ROUTE): that program also groups the pairs by expert in groups of
    GROUP_COLS for the grouped columns (_moe_columns._group_pairs into ``group_expert_ptr`` /
    ``group_pairs_ptr``, ``g_max`` groups; the pairs of tokens at or past ``valid_rows[0]``
    in none), which then need no grouping launch of their own.
    PRELOAD (one step, BLOCK_K ≥ H): the weights are loaded before the PDL wait, so that
    after it only x's load (from L2) stands between the norm before and the logits."""
    pid = tl.program_id(0)
    experts = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    ONE_STEP: tl.constexpr = PRELOAD and BLOCK_K >= H
    WIDTH: tl.constexpr = 128 * ((H + 127) // 128)  # a tile-order row
    if ONE_STEP:
        w_first = _router_weights(weight_ptr, experts, tl.arange(0, BLOCK_K), H, E)
    if PDL:  # x comes from the previous kernel
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    tokens = tl.arange(0, T_PAD)
    token_mask = tokens < num_tokens
    acc = tl.zeros([T_PAD, BLOCK_E], tl.float32)
    for k0 in tl.range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + ks[None, :],
            mask=token_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if ONE_STEP:  # noqa: SIM108 (w_first exists only then: Triton folds this if)
            w = w_first
        else:
            w = _router_weights(weight_ptr, experts, ks, H, E)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if (k0 // BLOCK_K) % tl.num_programs(0) == pid:
            if TILE_ORDER:  # BLOCK_K a multiple of 128: whole steps (x is 0 past H)
                steps = tl.reshape(x, [T_PAD * (BLOCK_K // 128), 128])
                tl.store(
                    x_thread_ptr + tokens[:, None] * WIDTH + ks[None, :],
                    tl.reshape(_tile_order_step(steps, TILE_ORDER), [T_PAD, BLOCK_K]),
                    mask=token_mask[:, None] & (ks < WIDTH)[None, :],
                )
            else:
                tl.store(
                    x_thread_ptr + tokens[:, None] * H + ks[None, :],
                    _thread_order(x, BLOCK_K),
                    mask=token_mask[:, None] & k_mask[None, :],
                )
    if PDL and not EARLY:  # the next kernel's programs may come in now, for this one's tail
        gdc_launch_dependents()
    bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
    mask = token_mask[:, None] & (experts < E)[None, :]
    tl.store(logits_ptr + tokens[:, None] * E + experts[None, :], acc + bias[None, :], mask=mask)
    if ROUTE:
        _route_when_last(
            logits_ptr, counter_ptr, expert_ids_ptr, routing_weights_ptr, tokens, token_mask,
            valid_rows_ptr, group_expert_ptr, group_pairs_ptr, num_tokens, g_max,
            E, TOP_K, GROUP_COLS, GROUP_FILL,
        )  # fmt: skip


@triton.jit
def _router_weights(weight_ptr, experts, ks, H: tl.constexpr, E: tl.constexpr):
    """Router weights [BLOCK_E, BLOCK_K] bf16 of ``experts`` x columns ``ks`` (0 past the ends)."""
    return tl.load(
        weight_ptr + experts[:, None] * H + ks[None, :],
        mask=(experts < E)[:, None] & (ks < H)[None, :],
        other=0.0,
    )


@triton.jit
def _route_when_last(
    logits_ptr, counter_ptr, expert_ids_ptr, routing_weights_ptr, tokens, token_mask,
    valid_rows_ptr, group_expert_ptr, group_pairs_ptr, num_tokens, g_max,
    E: tl.constexpr, TOP_K: tl.constexpr, GROUP_COLS: tl.constexpr, GROUP_FILL: tl.constexpr,
):  # fmt: skip
    """The last router program: top-k + softmax of every token from all the logits, and with
    GROUP_COLS the pairs' groups (``_router_kernel``)."""
    # The barrier orders the whole program's logit stores before the (release) ticket; the
    # last ticket's acquire makes every program's stores visible, read through L2 (.cg).
    E_PAD: tl.constexpr = triton.next_power_of_2(E)
    K_PAD: tl.constexpr = triton.next_power_of_2(TOP_K)
    P_PAD: tl.constexpr = triton.next_power_of_2(tokens.shape[0] * TOP_K)  # the pairs, padded
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        experts = tl.arange(0, E_PAD)
        logits = tl.load(
            logits_ptr + tokens[:, None] * E + experts[None, :],
            mask=token_mask[:, None] & (experts < E)[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        _write_routing(
            expert_ids_ptr, routing_weights_ptr, logits, tokens, token_mask, TOP_K, K_PAD
        )
        if GROUP_COLS > 0:  # the ids just stored, read back by other threads of this program
            tl.debug_barrier()
            num_valid = _num_valid(valid_rows_ptr, num_tokens * TOP_K, TOP_K)
            _group_pairs(expert_ids_ptr, group_expert_ptr, group_pairs_ptr, num_valid, g_max,
                         GROUP_COLS, P_PAD, E_PAD, GROUP_FILL)  # fmt: skip
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


@triton.jit
def _part_groups(part, G: tl.constexpr, SPLIT_GROUPS: tl.constexpr):
    """Groups of K part ``part`` (parts of SPLIT_GROUPS, the last one shorter)."""
    return tl.minimum(G - part * SPLIT_GROUPS, SPLIT_GROUPS)


@triton.jit
def _token_slot_routing(logits_ptr, token, slot, E: tl.constexpr, TOP_K: tl.constexpr,
                        COPIES: tl.constexpr):  # fmt: skip
    """(expert id, routing weight) of slot ``slot`` of one token, from its logits: each of
    COPIES rows (one per warp) holds all the logits and runs the top-k on its own, so its
    reductions stay inside a warp (shuffles, no barrier); only the final pick crosses warps.
    COPIES = 1: one row spread over all the program's warps."""
    E_PAD: tl.constexpr = triton.next_power_of_2(E)
    K_PAD: tl.constexpr = triton.next_power_of_2(TOP_K)
    experts = tl.arange(0, E_PAD)[None, :]
    copies = tl.arange(0, COPIES)[:, None]
    logits = tl.load(logits_ptr + token * E + experts + 0 * copies,
                     mask=(experts < E) & (copies >= 0), other=float("-inf"))  # fmt: skip
    ids, weights = _topk_softmax(logits, TOP_K, K_PAD)  # [COPIES, K_PAD], equal rows
    chosen = tl.arange(0, K_PAD)[None, :] == slot
    expert = tl.max(tl.sum(tl.where(chosen, ids, 0), axis=1), axis=0)
    weight = tl.max(tl.sum(tl.where(chosen, weights, 0.0), axis=1), axis=0)
    return expert, weight


@triton.jit
def _pair_expert(
    logits_ptr, expert_ids_ptr, routing_weights_ptr, pair, col_block, E: tl.constexpr,
    TOP_K: tl.constexpr, ROUTED: tl.constexpr, WARP_TOPK: tl.constexpr,
):  # fmt: skip
    """The expert of ``pair``: given (ROUTED), or from its token's logits, by WARP_TOPK warps
    each on its own copy (``_token_slot_routing``) or by the whole program; then the programs
    of row tile 0 write the pair's expert id and routing weight."""
    if ROUTED:
        expert = tl.load(expert_ids_ptr + pair)
    else:
        expert, weight = _token_slot_routing(logits_ptr, pair // TOP_K, pair % TOP_K, E, TOP_K,
                                             max(WARP_TOPK, 1))  # fmt: skip
        if col_block == 0:
            tl.store(expert_ids_ptr + pair, expert)
            tl.store(routing_weights_ptr + pair, weight)
    return expert


@triton.jit
def _gate_up_kernel(
    x_thread_ptr, logits_ptr, expert_ids_ptr, routing_weights_ptr,
    blocks_ptr, scales_ptr, bias_ptr, h_ptr, num_pairs, alpha, limit,
    H: tl.constexpr, N: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr,
    ROUTED: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, SPLIT_GROUPS: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, UNROLL: tl.constexpr,
    NUM_STAGES: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
    LB: tl.constexpr = 1, WARP_TOPK: tl.constexpr = 0,
):  # fmt: skip
    """h[p, :] (thread order, bf16 [P, N/2]) for R = BN/SPLIT rows [n0, n0 + R) of the pair's
    expert. The K columns are split in SPLIT parts of SPLIT_GROUPS groups: tile row s·R + r
    reads part s of row n0 + r against activation column s, so more warps share a row tile.

    ROUTED: expert ids and weights [P] are given; else from the logits, and written here."""
    R: tl.constexpr = BN // SPLIT
    G: tl.constexpr = H // 32
    GS: tl.constexpr = _stored_groups(G, LB)  # a row's groups as stored (bands: whole steps)
    pair = tl.program_id(0) % num_pairs
    col_block = tl.program_id(0) // num_pairs  # pairs fastest: concurrent programs share rows
    token = pair // TOP_K
    if PDL:
        gdc_wait()  # the router's logits (or routing) and x_thread
    expert = _pair_expert(logits_ptr, expert_ids_ptr, routing_weights_ptr, pair, col_block, E,
                          TOP_K, ROUTED, WARP_TOPK)  # fmt: skip
    n0 = col_block * R
    rows, t = _tile_slots(BN)
    part = rows // R
    row = n0 + rows % R
    row_groups = tl.where(row < N, _part_groups(part, G, SPLIT_GROUPS), 0)
    row = tl.minimum(row, N - 1)  # rows past the end read row N - 1 (unmasked main loop)
    expert = expert.to(tl.int64)
    first_group = part * SPLIT_GROUPS + t
    block_rows = _slot_blocks(blocks_ptr + expert * (N * GS * 16), row, first_group, G, LB)
    scale_rows = scales_ptr + expert * (N * GS) + row * GS + first_group
    # 8 activation columns (one n8 MMA), column c holding part c % SPLIT: each lane loads
    # just its own column, and the load matches the MMA operand's lanes (no shuffle).
    cols = tl.arange(0, 8)
    col_part = cols % SPLIT
    col_ptrs = x_thread_ptr + token * H + col_part * (32 * SPLIT_GROUPS)
    acc, _ = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, col_ptrs, _part_groups(col_part, G, SPLIT_GROUPS),
        BN, STEPS, FULL_STEPS, UNROLL, NUM_STAGES, PTX, INTERPRET, LB=LB,
    )  # fmt: skip
    if PDL:  # late: programs waiting beside this kernel's stream slow it (T = 1: 1.5x)
        gdc_launch_dependents()
    keep = (tl.arange(0, BN) // R)[:, None] == cols[None, :]  # row s·R + r: column s
    y = tl.sum(tl.reshape(tl.sum(tl.where(keep, acc, 0.0), axis=1), [SPLIT, R]), axis=0)
    out_rows = n0 + tl.arange(0, R)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    y = y * ACC_SCALE + bias.to(tl.float32)
    gate, up = tl.split(tl.reshape(y, [R // 2, 2]))  # rows interleaved: 2j gate j, 2j+1 up j
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = _to_bf16(gate * tl.sigmoid(alpha * gate) * (up + 1.0), INTERPRET)
    units = n0 // 2 + tl.arange(0, R // 2)  # units j, stored at their thread-order position
    position = (units & ~7) | ((units & 1) << 2) | (units & 2) | ((units >> 2) & 1)
    tl.store(h_ptr + pair * (N // 2) + position, h, mask=units < N // 2)


@triton.jit
def _down_kernel(
    h_ptr, expert_ids_ptr, routing_weights_ptr, blocks_ptr, scales_ptr, bias_ptr,
    out_ptr, stride_out,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BR: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_GROUPS: tl.constexpr, STEPS: tl.constexpr,
    FULL_STEPS: tl.constexpr, UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr,
    PTX: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr, LB: tl.constexpr = 1,
    EARLY: tl.constexpr = False,
):  # fmt: skip
    """out[token, n0 : n0 + BR] = Σ_e w_e · (h_e @ W_down[e][rows]^T + b_e), bf16 (K = I).

    Tile row (e·SPLIT + s)·BR + r reads part s of the K columns of row n0 + r of the token's
    e-th expert; its activation column is c = e·SPLIT + s (the pair's h, part s)."""
    K_PAD: tl.constexpr = triton.next_power_of_2(TOP_K)
    BN: tl.constexpr = K_PAD * SPLIT * BR
    G: tl.constexpr = K // 32
    GS: tl.constexpr = _stored_groups(G, LB)  # a row's groups as stored (bands: whole steps)
    token = tl.program_id(0)
    n0 = tl.program_id(1) * BR
    slots = tl.arange(0, K_PAD)
    slot_mask = slots < TOP_K
    if PDL:
        if EARLY:  # the next kernels (norm, q/k/v) launch beside this one's stream
            gdc_launch_dependents()
        gdc_wait()  # h, and the routing
    ids = tl.load(expert_ids_ptr + token * TOP_K + slots, mask=slot_mask, other=0).to(tl.int64)
    weights = tl.load(routing_weights_ptr + token * TOP_K + slots, mask=slot_mask, other=0.0)
    rows, t = _tile_slots(BN)
    column = rows // BR
    slot = column // SPLIT
    part = column % SPLIT
    row = n0 + rows % BR
    row_groups = tl.where((row < N) & (slot < TOP_K), _part_groups(part, G, SPLIT_GROUPS), 0)
    row = tl.minimum(row, N - 1)  # rows past the end read row N - 1 (unmasked main loop)
    row_expert = tl.sum(tl.where(slot[:, None] == slots[None, :], ids[None, :], 0), 1)
    first_group = part * SPLIT_GROUPS + t
    block_rows = _slot_blocks(blocks_ptr + row_expert * (N * GS * 16), row, first_group, G, LB)
    scale_rows = scales_ptr + row_expert * (N * GS) + row * GS + first_group
    # At least 8 activation columns (one n8 MMA; each lane loads its own column): column c is
    # part c % SPLIT of slot c // SPLIT, wrapped; padding slots read slot TOP_K - 1.
    cols = tl.arange(0, max(8, K_PAD * SPLIT))
    col_slot = (cols // SPLIT) % K_PAD
    col_part = cols % SPLIT
    col_ptrs = h_ptr + (token * TOP_K + tl.minimum(col_slot, TOP_K - 1)) * K
    col_ptrs += col_part * (32 * SPLIT_GROUPS)
    col_groups = tl.where(col_slot < TOP_K, _part_groups(col_part, G, SPLIT_GROUPS), 0)
    acc, _ = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, col_ptrs, col_groups,
        BN, STEPS, FULL_STEPS, UNROLL, NUM_STAGES, PTX, INTERPRET, LB=LB,
    )  # fmt: skip
    if PDL and not EARLY:  # late by default: programs waiting beside this stream slowed it
        gdc_launch_dependents()
    keep = (tl.arange(0, BN) // BR)[:, None] == cols[None, :]  # tile row: its own column
    y = tl.reshape(tl.sum(tl.where(keep, acc, 0.0), axis=1), [K_PAD, SPLIT, BR])
    y = tl.sum(y, axis=1) * ACC_SCALE  # [K_PAD, BR]
    out_cols = n0 + tl.arange(0, BR)
    bias = tl.load(
        bias_ptr + ids[:, None] * N + out_cols[None, :],
        mask=slot_mask[:, None] & (out_cols < N)[None, :],
        other=0.0,
    )
    y = (y + bias.to(tl.float32)) * weights[:, None]
    out = tl.sum(y, axis=0)  # the k experts, in a fixed order
    tl.store(out_ptr + token * stride_out + out_cols, _to_bf16(out, INTERPRET), mask=out_cols < N)
