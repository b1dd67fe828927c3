"""Host side of the GEMV-shaped MXFP4 MoE, the "decode path" (T ≤ DECODE_MAX_TOKENS, which now
reaches prefill chunks too): buffers and launches; the launch shapes by token count are
_moe_tiles.py's.

Up to 4 tokens, on an H100 up to 8 (per-pair GEMVs, 3 launches; PER_PAIR_MAX_TOKENS_BY_CARD):

    _router_kernel   logits [T, E] fp32, x in thread order, and     (E / router_experts programs)
                     in its last program the top-k routing
    _gate_up_kernel  h [T·k, I] bf16                                 (T·k x 2I / gate_up_rows)
    _down_kernel     out [T, H] = Σ_k w · (h @ Wd^T + bd), in-program (T x H / down_rows)

No device-to-host sync (CUDA-graph capturable) and bitwise repeatable: the one atomic is the
router's ticket, and the routing does not depend on which program draws the last one. Each (token,
slot) pair streams its own expert's rows, so a token count whose pairs share experts reads those
rows more than once from L2 (not from HBM: the programs of one row tile run together, pairs
fastest). From 5 tokens (9 on an H100) the pairs are grouped by expert (_moe_columns.py,
``launch_columns``: 5 launches, 4 up to 16 tokens where the router's last program also groups the
pairs (``group_in_router``), 6 from 17 tokens with the K-split router; past 4096 pairs the
grouping is the prefill one's count / block table / scatter, whose atomics may deal an expert's
pairs to its groups in another order, which changes no value: each pair is its own MMA column); past
DECODE_MAX_TOKENS the grouped GEMMs of _moe_triton.py take over.
See _moe_gemv.py for the tile layout and the decode, _moe_decode.py for the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from gptoss_serve.kernels import _moe_columns as columns
from gptoss_serve.kernels import _moe_decode as decode
from gptoss_serve.kernels import _moe_gemm as gemm
from gptoss_serve.kernels import _moe_gemv as gemv
from gptoss_serve.kernels import _moe_router_split as router_split
from gptoss_serve.kernels import _moe_routing as routing
from gptoss_serve.kernels import _moe_tiles as tile_table
from gptoss_serve.kernels._moe_tiles import (
    DecodeTiles,
    decode_tiles_for,
    router_block_k,
    routes_in_router,
)
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.moe import MoeWeights


@dataclass(frozen=True)
class DecodeResult:
    out: torch.Tensor  # [T, H] in x's dtype
    expert_ids: torch.Tensor  # [T, k] int32
    routing_weights: torch.Tensor  # [T, k] fp32
    logits: torch.Tensor | None  # [T, E] fp32 (None when the routing was given)


def thread_order(x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> the GEMVs' activation order: in each block of 8, bits 0 and 2 of the index
    exchanged (an involution; _moe_gemv.py says why)."""
    t, h = x.shape
    return x.reshape(t, h // 8, 2, 2, 2).permute(0, 1, 4, 3, 2).reshape(t, h)


def tile_order(x: torch.Tensor, order: int = gemv.ORDER_MMA) -> torch.Tensor:
    """[T, H] -> [T, 128·ceil(H / 128)] in the GEMV tile's column order, zero padded: in each
    step of 128, element 32t + 8q + 4h + 2m + p goes to column 32q + 16m + 4t + 2p + h, or
    with ``order`` ORDER_WGMMA to 32q + 16m + 8p + 2t + h."""
    t, h = x.shape
    width = row_width(h, True)
    padded = torch.nn.functional.pad(x, (0, width - h))
    tiles = padded.reshape(t, width // 128, 4, 4, 2, 2, 2)  # t q h m p
    if order == gemv.ORDER_WGMMA:
        return tiles.permute(0, 1, 3, 5, 6, 2, 4).reshape(t, width)  # q m p t h
    return tiles.permute(0, 1, 3, 5, 2, 6, 4).reshape(t, width)  # q m t p h


def mxfp4_moe_decode(
    x: torch.Tensor,
    weights: MoeWeights,
    *,
    top_k: int = 4,
    alpha: float = 1.702,
    limit: float = 7.0,
    tiles: DecodeTiles | None = None,
    out: torch.Tensor | None = None,
    poison: bool = False,
    expert_ids: torch.Tensor | None = None,
    routing_weights: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
) -> DecodeResult:
    """x [T, H] bf16 -> the MoE output; with ``expert_ids``/``routing_weights`` [T, k] given,
    the router is skipped (tests feed a routing computed once in fp32).

    ``tiles`` overrides ``decode_tiles_for(T)``; ``out`` [T, H] receives the result;
    ``poison`` fills the scratch buffers with NaN. ``valid_rows`` (int32 [1] on x's device,
    read by the kernels; None: all rows): the rows from ``valid_rows[0]`` on are padding, their
    pairs left out of the groups and their output rows zero. Only the grouped columns
    (``tiles.group_columns``: from 5 tokens in the table) read it; the per-pair GEMVs (1-4
    tokens, 1-8 on an H100) ignore it, so that the batch-1 kernels, bound by their latency,
    take no load before their main loop for it: the engine's graphs are captured at every
    size up to 8, so its padded steps have 9 rows or more (engine/cuda_graphs.py)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the Triton MoE takes bf16 activations, got {x.dtype}")
    tiles = tiles or decode_tiles_for(x.shape[0], x.device)
    x = x.contiguous()
    num_tokens, hidden = x.shape
    device = x.device
    groups = None  # the grouped columns' groups, where the router writes them
    if expert_ids is not None:
        top_k = expert_ids.shape[1]
        ids = expert_ids.to(torch.int32).contiguous()
        gates = routing_weights.to(torch.float32).contiguous()
        x_thread = tile_order(x, tiles.order) if tiles.tile_order else thread_order(x).contiguous()
        logits, routed_here = None, True  # given: the GEMVs read it
    else:
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
        gates = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
        # x for the GEMVs, written by the router: thread order, or a tile order (padded to
        # whole steps).
        x_thread = _scratch((num_tokens, row_width(hidden, tiles.tile_order)), torch.bfloat16,
                            device, poison)  # fmt: skip
        logits = _scratch((num_tokens, weights.num_experts), torch.float32, device, poison)
        # The router's last program writes the routing once, or gate_up computes it from the
        # logits (and writes it for down). Past ROUTER_MAX_TOKENS the K-split router does.
        routed_here = routes_in_router(tiles) or num_tokens > tile_table.ROUTER_MAX_TOKENS
        if groups_in_router(tiles, num_tokens):
            groups = group_buffers(num_tokens * top_k, weights.num_experts, tiles, device)
        launch_router(
            x, weights, logits, x_thread, tiles, ids=ids if routed_here else None, gates=gates,
            groups=groups, valid_rows=valid_rows,
        )  # fmt: skip
        if num_tokens > tile_table.ROUTER_MAX_TOKENS:
            logits = None  # not computed
    inter_width = row_width(weights.intermediate_size, tiles.tile_order)
    h = _scratch((num_tokens * top_k, inter_width), torch.bfloat16, device, poison)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    if tiles.group_columns:
        launch_columns(
            weights, x_thread, ids, gates, h=h, out=out, tiles=tiles, alpha=alpha, limit=limit,
            poison=poison, valid_rows=valid_rows, groups=groups,
        )  # fmt: skip
        return DecodeResult(out, ids, gates, logits)
    gemv_logits = None if routed_here else logits  # None: the GEMVs read ids/gates
    launch_gate_up(
        weights, x_thread, gemv_logits, ids, gates, h=h, tiles=tiles, alpha=alpha, limit=limit
    )
    launch_down(weights, h, ids, gates, out=out, tiles=tiles)
    return DecodeResult(out, ids, gates, logits)


def launch_router(
    x: torch.Tensor,
    weights: MoeWeights,
    logits: torch.Tensor,
    x_thread: torch.Tensor,
    tiles: DecodeTiles,
    *,
    ids: torch.Tensor | None = None,
    gates: torch.Tensor | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    valid_rows: torch.Tensor | None = None,
) -> None:
    """x [T, H] -> logits [T, E] fp32 and x_thread: [T, H] in thread order, or with
    ``tiles.tile_order`` [T, 128·ceil(H / 128)] in ``tiles.order``; with ``ids`` and ``gates``
    [T, k] given, also the top-k routing into them, and with ``groups`` (``group_buffers``,
    ``groups_in_router``) the pairs' groups by expert, as ``group`` writes them (the pairs of
    rows from ``valid_rows[0]`` on in none). Past ROUTER_MAX_TOKENS tokens: the routing
    (``ids`` required) and x_thread only, through the K-split router."""
    num_tokens, hidden = x.shape
    route = ids is not None
    if groups is not None and not (route and groups_in_router(tiles, num_tokens)):
        raise ValueError("the router groups the pairs only where it routes (groups_in_router)")
    if num_tokens > tile_table.ROUTER_MAX_TOKENS:
        if not route:
            raise ValueError(
                f"past {tile_table.ROUTER_MAX_TOKENS} tokens the router must write the routing"
            )
        _launch_wide_router(x, weights, x_thread, ids, gates, pdl=_pdl(tiles), order=tiles.order,
                            split_k=tiles.router_split_k, block_t=tiles.router_block_t,
                            finish_tokens=tiles.router_finish_tokens)  # fmt: skip
        return
    _check_rows("x_thread", x_thread, hidden, tiles.tile_order)
    counter = weights.router_counter
    if route and counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    block_e = tiles.router_experts
    block_k = router_block_k(tiles, num_tokens, hidden)
    group_expert, group_pairs = groups or (logits, logits)  # without groups: never read
    grouping = {}
    if groups is not None:
        fill = _group_fill(ids.numel(), weights.num_experts, tiles)
        grouping = dict(GROUP_COLS=tiles.group_size, GROUP_FILL=fill)
    launcher(decode._router_kernel)[(triton.cdiv(weights.num_experts, block_e),)](
        x, weights.router_weight, weights.router_bias, logits, x_thread,
        counter if route else logits, ids if route else logits, gates if route else logits,
        num_tokens, x.stride(0), valid_rows, group_expert, group_pairs, group_expert.shape[0],
        H=hidden, E=weights.num_experts, T_PAD=_pow2(num_tokens), BLOCK_E=block_e,
        BLOCK_K=block_k, TOP_K=ids.shape[1] if route else 1, ROUTE=route, PDL=_pdl(tiles),
        PRELOAD=tiles.router_preload, TILE_ORDER=tiles.order,
        EARLY=tiles.router_early_dependents, num_warps=4, launch_pdl=_pdl(tiles), **grouping,
    )  # fmt: skip


def _launch_wide_router(
    x: torch.Tensor,
    weights: MoeWeights,
    x_thread: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    *,
    pdl: bool = False,
    split_k: int = DecodeTiles.router_split_k,
    block_t: int = DecodeTiles.router_block_t,
    order: int = gemv.ORDER_THREAD,
    finish_tokens: int = DecodeTiles.router_finish_tokens,
) -> None:
    """More tokens: the router GEMM split over K (_moe_router_split.py), 2 launches. x goes
    to ``x_thread`` in ``order`` (_moe_gemv.ORDER_*; a tile order: rows 128·ceil(H / 128)
    long)."""
    tile_order = order != gemv.ORDER_THREAD
    num_tokens, hidden = x.shape
    top_k, num_experts = ids.shape[1], weights.num_experts
    e_pad, block_k = max(16, _pow2(num_experts)), min(64, split_k)
    if tile_order:  # whole 128-column steps, each permuted in registers and stored at once
        block_k, split_k = 128, 128 * triton.cdiv(split_k, 128)
    num_parts = triton.cdiv(hidden, split_k)
    _check_rows("x_thread", x_thread, hidden, tile_order)
    partial = torch.empty(num_parts, num_tokens, num_experts, dtype=torch.float32,
                          device=x.device)  # fmt: skip
    launcher(router_split._router_split_kernel)[(triton.cdiv(num_tokens, block_t), num_parts)](
        x, weights.router_weight, partial, x_thread, num_tokens, x.stride(0), H=hidden,
        E=num_experts, E_PAD=e_pad, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_K=split_k,
        PDL=pdl, INTERPRET=_interpreting(), TILE_ORDER=order, X_STRIDE=x_thread.stride(0),
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    launcher(router_split._router_finish_kernel)[(triton.cdiv(num_tokens, finish_tokens),)](
        partial, weights.router_bias, ids, gates, num_tokens, NUM_PARTS=num_parts, E=num_experts,
        E_PAD=e_pad, BLOCK_T=finish_tokens, TOP_K=top_k, K_PAD=_pow2(top_k), PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip


def launch_gate_up(
    weights: MoeWeights,
    x_thread: torch.Tensor,
    logits: torch.Tensor | None,
    ids: torch.Tensor,
    gates: torch.Tensor,
    *,
    h: torch.Tensor,
    tiles: DecodeTiles,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None:
    """h [T·k, I] (thread order) from x_thread; the top-k from ``logits`` (written to ``ids``
    and ``gates`` [T, k]), or read from ``ids`` when ``logits`` is None."""
    num_tokens, hidden = x_thread.shape
    top_k, inter = ids.shape[1], weights.intermediate_size
    num_pairs = num_tokens * top_k
    pdl = _pdl(tiles)
    rows, split = tiles.gate_up_rows, tiles.gate_up_split
    launcher(decode._gate_up_kernel)[(num_pairs * triton.cdiv(2 * inter, rows),)](
        x_thread, gates if logits is None else logits, ids, gates,
        weights.gate_up_blocks, weights.gate_up_scales, weights.gate_up_bias, h,
        num_pairs, alpha, limit,
        H=hidden, N=2 * inter, E=weights.num_experts, TOP_K=top_k, ROUTED=logits is None,
        BN=rows * split, SPLIT=split, **split_plan(hidden, split, tiles.gate_up_unroll),
        NUM_STAGES=tiles.gate_up_stages, PTX=tiles.ptx and not _interpreting(), PDL=pdl,
        INTERPRET=_interpreting(), LB=weights.step_rows, num_warps=tiles.gate_up_warps,
        num_stages=tiles.gate_up_stages, launch_pdl=pdl,
        WARP_TOPK=tiles.topk_copies,
    )  # fmt: skip


def launch_down(
    weights: MoeWeights,
    h: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    *,
    out: torch.Tensor,
    tiles: DecodeTiles,
) -> None:
    """out [T, H] = Σ_k gates · (h @ Wd[ids]^T + bd[ids]), the k experts summed in-program."""
    num_tokens, top_k = ids.shape
    pdl = _pdl(tiles)
    hidden, inter = weights.hidden_size, weights.intermediate_size
    rows, split = tiles.down_rows, tiles.down_split
    if _pow2(top_k) * split * rows < 16:
        raise ValueError(f"k · down_split · down_rows must be at least 16, got {tiles}")
    launcher(decode._down_kernel)[(num_tokens, triton.cdiv(hidden, rows))](
        h, ids, gates,
        weights.down_blocks, weights.down_scales, weights.down_bias, out, out.stride(0),
        N=hidden, K=inter, TOP_K=top_k, BR=rows, SPLIT=split,
        **split_plan(inter, split, tiles.down_unroll), NUM_STAGES=tiles.down_stages,
        PTX=tiles.ptx and not _interpreting(), PDL=pdl, INTERPRET=_interpreting(),
        LB=weights.step_rows, num_warps=tiles.down_warps, num_stages=tiles.down_stages,
        EARLY=tiles.down_early_dependents, launch_pdl=pdl,
    )  # fmt: skip


def launch_columns(
    weights: MoeWeights,
    x_thread: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    *,
    h: torch.Tensor,
    out: torch.Tensor,
    tiles: DecodeTiles,
    alpha: float = 1.702,
    limit: float = 7.0,
    poison: bool = False,
    valid_rows: torch.Tensor | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out [T, H] from x_thread and the routing ``ids``/``gates`` [T, k], the pairs grouped by
    expert (_moe_columns.py): group (unless ``groups`` holds the router's), gate_up, down into
    per-pair rows, the sum over each token's pairs. Four launches, a fixed grid, no host sync.
    With ``tiles.tile_order`` x_thread is x in tile order (``tile_order``) and ``h`` [T·k,
    128·ceil(I / 128)] receives h in it. ``valid_rows`` (int32 [1], None: all): the tokens
    from ``valid_rows[0]`` on are left out of the groups (no expert work) and their rows of
    ``out`` are zeros."""
    num_tokens, hidden = out.shape
    top_k, inter = ids.shape[1], weights.intermediate_size
    num_pairs = num_tokens * top_k
    pdl = _pdl(tiles)
    device = x_thread.device
    cols = tiles.group_size
    group_expert, group_pairs = groups or group(ids, weights.num_experts, tiles, valid_rows)
    g_max = group_expert.shape[0]
    _check_rows("x_thread", x_thread, hidden, tiles.tile_order)
    _check_rows("h", h, inter, tiles.tile_order)
    order = dict(TILE_ORDER=tiles.order, H_STRIDE=h.stride(0), SCALE_WORDS=tiles.scale_words,
                 LB=weights.step_rows)  # fmt: skip
    # Blocks and scales padded to whole steps (bands) and activations in a tile order (zero
    # past K): every step is whole, the loop unmasked (bench/RESULTS.md v15).
    whole = weights.step_rows > 1 and tiles.tile_order
    rows = tiles.gate_up_rows
    launcher(columns._columns_gate_up_kernel)[(triton.cdiv(2 * inter, rows), g_max)](
        x_thread, group_expert, group_pairs, weights.gate_up_blocks, weights.gate_up_scales,
        weights.gate_up_bias, h, alpha, limit, H=hidden, N=2 * inter, TOP_K=top_k, BN=rows,
        COLS=cols,
        **_full_steps(hidden, whole=whole), NUM_STAGES=tiles.gate_up_stages,
        PTX=tiles.ptx and not _interpreting(), PDL=pdl, INTERPRET=_interpreting(),
        num_warps=tiles.gate_up_warps, num_stages=tiles.gate_up_stages, launch_pdl=pdl,
        X_STRIDE=x_thread.stride(0), EXTRA=tiles.next_group_columns, **order,
    )  # fmt: skip
    y = _scratch((num_pairs, hidden), PAIR_DTYPE, device, poison)
    rows = tiles.down_rows
    launcher(columns._columns_down_kernel)[(triton.cdiv(hidden, rows), g_max)](
        h, group_expert, group_pairs, gates, weights.down_blocks, weights.down_scales,
        weights.down_bias, y, y.stride(0), N=hidden, K=inter, TOP_K=top_k, BN=rows, COLS=cols,
        **_full_steps(inter, whole=whole), NUM_STAGES=tiles.down_stages,
        PTX=tiles.ptx and not _interpreting(), PDL=pdl, INTERPRET=_interpreting(),
        num_warps=tiles.down_warps, num_stages=tiles.down_stages, launch_pdl=pdl,
        EXTRA=tiles.next_group_columns, **order,
    )  # fmt: skip
    sum_pairs(y, out, top_k, valid_rows)


def group(
    ids: torch.Tensor,
    num_experts: int,
    tiles: DecodeTiles,
    valid_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing ``ids`` [T, k] (int32, contiguous) in groups of ``tiles.group_size`` pairs
    of one expert: (group_expert [G_MAX], group_pairs [G_MAX, size]), -1 where unused; the
    pairs of tokens from ``valid_rows[0]`` on (int32 [1]; None: none) in no group."""
    num_pairs, cols = ids.numel(), tiles.group_size
    group_expert, group_pairs = group_buffers(num_pairs, num_experts, tiles, ids.device)
    g_max = group_expert.shape[0]
    if num_pairs > columns.SORT_MAX_PAIRS:
        _group_by_table(ids, num_experts, group_expert, group_pairs, valid_rows)
        return group_expert, group_pairs
    pdl = _pdl(tiles)
    launcher(columns._group_kernel)[(1,)](
        ids, group_expert, group_pairs, num_pairs, valid_rows, g_max, COLS=cols,
        P_PAD=_pow2(num_pairs), E_PAD=_pow2(num_experts),
        FILL=_group_fill(num_pairs, num_experts, tiles), PDL=pdl, TOP_K=ids.shape[1],
        num_warps=8, launch_pdl=pdl,
    )  # fmt: skip
    return group_expert, group_pairs


def groups_in_router(tiles: DecodeTiles, num_tokens: int) -> bool:
    """Whether the decode router's last program groups the pairs for the grouped columns
    (``tiles.group_in_router``, where the one-launch router routes)."""
    return (
        tiles.group_columns
        and tiles.group_in_router
        and routes_in_router(tiles)
        and num_tokens <= tile_table.ROUTER_MAX_TOKENS
    )


def group_buffers(
    num_pairs: int, num_experts: int, tiles: DecodeTiles, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_expert [G_MAX], group_pairs [G_MAX, tiles.group_size]) int32, unwritten, for
    ``num_pairs`` pairs (G_MAX: ``_moe_columns.max_groups``)."""
    g_max = columns.max_groups(num_pairs, num_experts, tiles.group_size)
    group_expert = torch.empty(g_max, dtype=torch.int32, device=device)
    return group_expert, torch.empty(g_max, tiles.group_size, dtype=torch.int32, device=device)


def _group_fill(num_pairs: int, num_experts: int, tiles: DecodeTiles) -> int:
    """Table entries the grouping clears a step. Constexprs by powers of two only (from the
    bound of the padded pairs): a value that follows the token count compiles the kernel anew
    for each one (engine/compile_watch.py)."""
    bound = columns.max_groups(_pow2(num_pairs), num_experts, tiles.group_size)
    return min(_GROUP_FILL, _pow2(bound * tiles.group_size))


def launch_block_table(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    sorted_pairs: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: torch.Tensor,
    valid_rows: torch.Tensor | None = None,
) -> None:
    """The prefill grouping (_moe_routing.py): the pairs of ``ids`` [T, k] (int32,
    contiguous) sorted by expert into ``sorted_pairs`` [P] and cut into blocks of up to
    ``block_m`` rows, ``block_table`` [3, max_blocks] (expert, row start, segment end) and
    ``num_blocks`` [1]. Count, table, scatter: three launches and a memset. The pairs of
    tokens from ``valid_rows[0]`` on (int32 [1]; None: none) are left out."""
    num_pairs, top_k = ids.numel(), ids.shape[1]
    e_pad = max(16, _pow2(num_experts))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    grid = (triton.cdiv(num_pairs, _PAIRS_BLOCK),)
    launcher(routing._count_kernel)[grid](
        ids, counts, num_pairs, valid_rows, E_PAD=e_pad, BLOCK=_PAIRS_BLOCK, TOP_K=top_k
    )
    max_blocks = block_table.shape[1]
    launcher(routing._block_table_kernel)[(triton.cdiv(max_blocks, _TABLE_CHUNK_PROGRAM),)](
        counts, cursor, block_table, num_blocks, num_experts, max_blocks,
        E_PAD=e_pad, BLOCK_M=block_m, CHUNK_B=_TABLE_CHUNK_PROGRAM,
    )  # fmt: skip
    launcher(routing._scatter_kernel)[grid](
        ids, cursor, sorted_pairs, num_pairs, valid_rows, BLOCK=_PAIRS_BLOCK, TOP_K=top_k
    )


def _group_by_table(
    ids: torch.Tensor,
    num_experts: int,
    group_expert: torch.Tensor,
    group_pairs: torch.Tensor,
    valid_rows: torch.Tensor | None,
) -> None:
    """Many pairs: the prefill grouping in blocks of group_size pairs (``launch_block_table``,
    without the pairs of padding tokens), then the table as groups."""
    g_max, cols = group_pairs.shape
    device = ids.device
    sorted_pairs = torch.empty(ids.numel(), dtype=torch.int32, device=device)
    block_table = torch.empty(3, g_max, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    launch_block_table(
        ids, num_experts, cols, sorted_pairs=sorted_pairs, block_table=block_table,
        num_blocks=num_blocks, valid_rows=valid_rows,
    )  # fmt: skip
    launcher(columns._table_groups_kernel)[(triton.cdiv(g_max, _TABLE_GROUPS),)](
        sorted_pairs, block_table, num_blocks, group_expert, group_pairs, g_max, COLS=cols,
        BLOCK_G=_TABLE_GROUPS,
    )  # fmt: skip


_SUM_BLOCK = 1024
# The grouped columns' per-pair outputs y [T·k, H] (down's w · (h @ Wd^T + bd), summed per token
# by sum_pairs in fp32). bf16, as vLLM's fused MoE keeps them, halves the bytes down writes and
# the sum reads (94 -> 47 MB a layer at 2048 tokens); each pair is rounded once before the sum
# (the layer's output moves by 2.7e-3 RMS relative to fp32 pairs). H100 (bench/RESULTS.md v22):
# the sum 36.7 -> 18.4 us a layer at 2048 tokens, 145 -> 78 at 8192; the engine's prefill of
# 2048 / 8192 tokens +1.0 / +2.2%.
PAIR_DTYPE = torch.bfloat16
_PAIRS_BLOCK = 1024  # pairs per program of the count and scatter kernels
TABLE_CHUNK = 64  # row blocks per step of the one-program block-table kernel (_moe_triton)
# Row blocks per program of the prefill grouping's block-table kernel. It was one program
# looping over chunks of TABLE_CHUNK: 19.5 / 54 us a layer at 2048 / 8192 tokens (the
# engine's prefill, H200; bench/RESULTS.md v12).
_TABLE_CHUNK_PROGRAM = 16
_TABLE_GROUPS = 16  # groups per program of _table_groups_kernel
_GROUP_FILL = 4096  # table entries cleared per step


def sum_pairs(
    y: torch.Tensor, out: torch.Tensor, top_k: int, valid_rows: torch.Tensor | None = None
) -> None:
    """out [T, H] (bf16) = Σ_slot y[t·k + slot] (y [T·k, H] fp32 or bf16, added in fp32), in
    slot order; zero rows from ``valid_rows[0]`` on (int32 [1]; None: none), whose y rows are
    not read."""
    num_tokens, hidden = out.shape
    launcher(gemm._sum_pairs_kernel)[(num_tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        y, out, hidden, y.stride(0), out.stride(0), valid_rows, TOP_K=top_k, BLOCK=_SUM_BLOCK,
        INTERPRET=_interpreting(),
    )  # fmt: skip


def row_width(k: int, tile_order: bool) -> int:
    """Row length of GEMV activations of K columns: whole 128-column steps in tile order."""
    return 128 * triton.cdiv(k, 128) if tile_order else k


def _check_rows(name: str, buffer: torch.Tensor, k: int, tile_order: bool) -> None:
    """A buffer too short for its order would be written past its rows: refuse it."""
    width = row_width(k, tile_order)
    if buffer.shape[1] < width:
        raise ValueError(f"{name} rows must hold {width} columns (tile order: whole "
                         f"128-steps), got {tuple(buffer.shape)}")  # fmt: skip


def _full_steps(k: int, *, whole: bool = False) -> dict[str, int]:
    """STEPS / FULL_STEPS of an unsplit, not unrolled K; ``whole``: weights and activations are
    padded with zeros to whole steps, so every step counts as full (no masks)."""
    plan = split_plan(k, 1)
    return {"STEPS": plan["STEPS"], "FULL_STEPS": plan["STEPS"] if whole else plan["FULL_STEPS"]}


def split_plan(k: int, split: int, unroll: int = 1) -> dict[str, int]:
    """K columns in ``split`` parts of whole 128-column steps: part s starts at group
    s · SPLIT_GROUPS; every part runs STEPS steps (a multiple of ``unroll``; steps past a part's
    end are masked), the first FULL_STEPS of which are in range for all parts. K = 2880 (90
    groups): split 1 is 22 full steps + 1 half, split 2 parts of 48 and 42 groups, 10 full steps
    + 2 partial (24 steps issued for 22.5 of data)."""
    groups = k // 32
    split_groups = 4 * _cdiv(_cdiv(groups, split), 4)
    steps = unroll * _cdiv(split_groups // 4, unroll)
    full = max(0, min(split_groups, groups - (split - 1) * split_groups) // 4)
    return {"SPLIT_GROUPS": split_groups, "STEPS": steps, "FULL_STEPS": full, "UNROLL": unroll}


def decode_debug(
    blocks: torch.Tensor, scales: torch.Tensor, *, ptx: bool = True, permuted: bool = False
) -> torch.Tensor:
    """Debug: the GEMV decode of each row's first group, [N, 16] bytes + [N] scales -> bf16
    [N, 32] in tile order (column 8q + 4m + 2p + h holds element 8q + 2m + p + 4h), times
    2^-62 like the tile. ``permuted``: the bytes' words are in the kernels' bit order
    (mxfp4_layout.permute_words)."""
    num_rows = blocks.shape[0]
    out = torch.empty(num_rows, 32, dtype=torch.bfloat16, device=blocks.device)
    launcher(gemv._decode_debug_kernel)[(triton.cdiv(num_rows, 16),)](
        blocks.contiguous(), scales.contiguous(), out, num_rows, PTX=ptx and not _interpreting(),
        PERMUTED=permuted,
    )  # fmt: skip
    return out


def _pdl(tiles: DecodeTiles) -> bool:
    """PDL needs a GPU (the callers pass x's device through kernels/launch.py)."""
    return tiles.pdl and not _interpreting()


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device, poison: bool) -> torch.Tensor:
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)
