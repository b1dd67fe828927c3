"""Host side of the Triton MXFP4 MoE: the tile table per regime, buffers, and the launches.

T ≤ DECODE_MAX_TOKENS goes to the GEMV-shaped decode path of _moe_small.py (3 launches); the
grouped path below takes the rest, and any call that passes ``tiles`` (its small-batch tiles
stay for tests and comparison). One call, with no device-to-host sync (CUDA-graph safe; every
size below is known from T):

    small batches (T ≤ 64, given tiles)      prefill (T > 64)
    _router_kernel: logits [T, E] fp32        _router_topk_kernel: ids, weights
    _route_small_kernel (1 program):          _count_kernel, _block_table_kernel,
      top-k + counting sort + block table       _scatter_kernel (atomics)
    _gate_up_kernel: h [P, I] bf16 (P = T·k pairs, rows grouped by expert, SwiGLU fused)
    _down_kernel: y [P, H] fp32 (bias and routing weight applied, rows in pair order)
    _sum_pairs_kernel: out [T, H] = Σ_k y[t·k + slot], slot order (deterministic)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton

from gptoss_serve.kernels import _moe_dequant as dequant
from gptoss_serve.kernels import _moe_gemm as gemm
from gptoss_serve.kernels import _moe_routing as routing
from gptoss_serve.kernels._moe_small import (
    TABLE_CHUNK,
    DecodeTiles,
    decode_tiles_for,
    launch_block_table,
    mxfp4_moe_decode,
    sum_pairs,
)
from gptoss_serve.kernels._moe_tiles import DECODE_MAX_TOKENS
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.moe import MoeWeights


@dataclass(frozen=True)
class GemmTiles:
    block_n: int  # output columns per program (gate_up: gate and up of block_n/2 units)
    block_k: int  # reduction step; a multiple of 32 (one MXFP4 group), a power of two
    num_warps: int
    num_stages: int
    swap_ab: bool = True  # decoded weights as wgmma's left operand, straight from registers


@dataclass(frozen=True)
class MoeTiles:
    """The tiles of one regime."""

    block_m: int  # pair rows per program; decode: ≥ the tokens one expert can get
    gate_up: GemmTiles
    down: GemmTiles
    small_routing: bool  # one-program routing + grouping (decode) vs multi-program (prefill)
    ptx_dequant: bool = True  # inline-PTX MXFP4 decode (GPU); False: the portable Triton one

    def __post_init__(self) -> None:
        # Triton 3.6 crashes ("Illegal shared layout") compiling a bf16 decode as wgmma's
        # shared-memory operand; swap_ab (register operand) or mma.sync tiles are fine.
        for gemm_tiles in (self.gate_up, self.down):
            if self.ptx_dequant and not gemm_tiles.swap_ab and self.block_m >= 64:
                raise ValueError("ptx_dequant with block_m >= 64 needs swap_ab=True")


# Decode (memory-bound), by token count: narrow column tiles so that even batch 1 (4 experts)
# spreads over the 132 SMs (gate_up 5760/64 x 4 = 360 programs, down 2880/32 x 4 = 360), long
# K steps, and block_m ≥ T so that each expert's weights are read once. swap_ab needs
# block_n ≥ 64 (wgmma's M); below that plain tl.dot is better.
_NARROW = GemmTiles(32, 256, 4, 3, swap_ab=False)
_WIDE = GemmTiles(64, 128, 4, 3)
SMALL_BATCH_TILES: tuple[tuple[int, MoeTiles], ...] = (
    (16, MoeTiles(16, _WIDE, _NARROW, small_routing=True)),
    (64, MoeTiles(32, _WIDE, _WIDE, small_routing=True)),
)
# Prefill, by mean rows per expert (T·k/E). Every row block decodes its expert's whole weight
# tile, and that decode (~7-8 SASS instructions per element) costs about as much as the MMAs,
# so block_m follows the rows an expert gets: one block per expert where possible. K = 2880 is
# 45 steps of 64, so no K masking.
_PREFILL = (GemmTiles(128, 64, 4, 4), GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 2))
PREFILL_TILES: tuple[tuple[float, MoeTiles], ...] = (
    # Up to 8 rows per expert (256 tokens: large decode batches), 16-row blocks with the
    # decode shapes: 1.10x the 64-row tiles at 96-256 tokens, 0.81x at 512
    # (bench/moe_mid_sweep.py on the H200; every expert's weights are decoded once either way).
    (8, MoeTiles(16, _WIDE, _NARROW, small_routing=False)),
    (48, MoeTiles(64, _PREFILL[0], _PREFILL[0], small_routing=False)),
    (112, MoeTiles(128, _PREFILL[1], _PREFILL[1], small_routing=False)),
    (math.inf, MoeTiles(256, _PREFILL[2], _PREFILL[2], small_routing=False)),
)


def tiles_for(num_tokens: int, num_experts: int, top_k: int = 4) -> MoeTiles:
    """Decode tiles by token count; prefill tiles by the mean rows per expert."""
    for max_tokens, tiles in SMALL_BATCH_TILES:
        if num_tokens <= max_tokens:
            return tiles
    rows_per_expert = num_tokens * top_k / num_experts
    return next(tiles for max_rows, tiles in PREFILL_TILES if rows_per_expert <= max_rows)


@dataclass(frozen=True)
class Grouping:
    """Pairs grouped by expert for the GEMMs (see _moe_routing.py for the meaning)."""

    sorted_pair_ids: torch.Tensor  # [P] int32
    block_table: torch.Tensor  # [3, max_blocks] int32: expert, row_start, row_end
    num_blocks: torch.Tensor  # [1] int32, on the device

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]


def mxfp4_moe_triton(
    x: torch.Tensor,
    weights: MoeWeights,
    *,
    top_k: int = 4,
    alpha: float = 1.702,
    limit: float = 7.0,
    tiles: MoeTiles | None = None,
    out: torch.Tensor | None = None,
    poison: bool = False,
    decode_tiles: DecodeTiles | None = None,
    pdl: bool = False,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of mxfp4_moe (also on CPU tensors under TRITON_INTERPRET=1).

    ``tiles`` forces the grouped path with those tiles; else T ≤ DECODE_MAX_TOKENS takes the
    decode path (``decode_tiles`` overrides its launch shapes). ``out`` [T, H] (rows
    contiguous) receives the result; ``poison`` fills the float scratch buffers with NaN so that
    a read of anything unwritten shows (tests). The weights must be contiguous, as
    MoeWeights.from_checkpoint makes them. ``pdl`` launches the decode path's kernels as
    programmatic dependent launches (GPU only; the grouped path ignores it). ``valid_rows``
    (int32 [1] on x's device; None: all rows): rows from ``valid_rows[0]`` on are padding,
    left out of the grouping, their output zeros (read on the device by the grouping and sum
    kernels; the decode path's per-pair GEMVs, 1-4 tokens (1-8 on an H100), ignore it:
    _moe_small.py).
    """
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    if tiles is None and _use_decode_path(x.shape[0], weights):
        if pdl:
            decode_tiles = dataclasses.replace(
                decode_tiles or decode_tiles_for(x.shape[0], x.device), pdl=True
            )
        return mxfp4_moe_decode(
            x, weights, top_k=top_k, alpha=alpha, limit=limit, tiles=decode_tiles, out=out,
            poison=poison, valid_rows=valid_rows,
        ).out  # fmt: skip
    tiles = tiles or tiles_for(x.shape[0], weights.num_experts, top_k)
    _, routing_weights, grouping = route_triton(
        x, weights, top_k=top_k, tiles=tiles, valid_rows=valid_rows
    )
    return _experts(
        x, weights, routing_weights, grouping,
        tiles=tiles, alpha=alpha, limit=limit, out=out, poison=poison, valid_rows=valid_rows,
    )  # fmt: skip


def moe_experts_triton(
    x: torch.Tensor,
    weights: MoeWeights,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    tiles: MoeTiles | None = None,
    out: torch.Tensor | None = None,
    poison: bool = False,
    decode_tiles: DecodeTiles | None = None,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert half with the routing given: expert_ids/routing_weights [T, k] -> [T, H].

    Tests feed it a routing computed once in fp32, so the GEMMs are checked without ties
    flipping experts between two routings. Path choice and ``valid_rows`` as in
    mxfp4_moe_triton."""
    if tiles is None and _use_decode_path(x.shape[0], weights):
        return mxfp4_moe_decode(
            x, weights, alpha=alpha, limit=limit, tiles=decode_tiles, out=out, poison=poison,
            expert_ids=expert_ids, routing_weights=routing_weights, valid_rows=valid_rows,
        ).out  # fmt: skip
    tiles = tiles or tiles_for(x.shape[0], weights.num_experts, expert_ids.shape[1])
    expert_ids = expert_ids.to(torch.int32).contiguous()
    grouping = group_pairs(expert_ids, weights.num_experts, tiles, valid_rows)
    flat_weights = routing_weights.to(torch.float32).contiguous()
    return _experts(
        x, weights, flat_weights, grouping,
        tiles=tiles, alpha=alpha, limit=limit, out=out, poison=poison, valid_rows=valid_rows,
    )  # fmt: skip


def _use_decode_path(num_tokens: int, weights: MoeWeights) -> bool:
    """Few tokens, and expert blocks the decode path can read as 16-byte words."""
    aligned = all(t.data_ptr() % 16 == 0 for t in (weights.gate_up_blocks, weights.down_blocks))
    return num_tokens <= DECODE_MAX_TOKENS and aligned


def route_triton(
    x: torch.Tensor,
    weights: MoeWeights,
    *,
    top_k: int,
    tiles: MoeTiles,
    valid_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Grouping]:
    """x [T, H] -> (expert_ids [T, k] int32, routing_weights [T, k] fp32, grouping); every
    token is routed, only those before ``valid_rows[0]`` (None: all) grouped."""
    num_tokens, hidden = x.shape
    num_experts = weights.num_experts
    x = x.contiguous()
    expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    routing_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if not tiles.small_routing:
        block_t, block_k = 32, 64
        launcher(routing._router_topk_kernel)[(triton.cdiv(num_tokens, block_t),)](
            x, weights.router_weight, weights.router_bias, expert_ids, routing_weights,
            num_tokens, num_experts, x.stride(0), HIDDEN=hidden,
            TOP_K=top_k, K_PAD=_pow2(top_k), BLOCK_T=block_t, E_PAD=_experts_pad(num_experts),
            BLOCK_K=block_k, INTERPRET=_interpreting(),
        )  # fmt: skip
        grouping = group_pairs(expert_ids, num_experts, tiles, valid_rows)
        return expert_ids, routing_weights, grouping
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    block_t, block_e, block_k = 16, 16, 256
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_experts, block_e))
    launcher(routing._router_kernel)[grid](
        x, weights.router_weight, weights.router_bias, logits,
        num_tokens, num_experts, x.stride(0),
        HIDDEN=hidden, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, INTERPRET=_interpreting(),
    )  # fmt: skip
    grouping = _group_small(
        logits, expert_ids, routing_weights, num_experts, tiles, valid_rows=valid_rows
    )
    return expert_ids, routing_weights, grouping


def group_pairs(
    expert_ids: torch.Tensor,
    num_experts: int,
    tiles: MoeTiles,
    valid_rows: torch.Tensor | None = None,
) -> Grouping:
    """expert_ids [T, k] int32 (contiguous) -> the pairs grouped by expert, on the device,
    but for those of tokens from ``valid_rows[0]`` on (int32 [1]; None: none)."""
    if tiles.small_routing:
        return _group_small(None, expert_ids, None, num_experts, tiles, valid_rows=valid_rows)
    grouping = _empty_grouping(expert_ids.numel(), num_experts, tiles.block_m, expert_ids.device)
    launch_block_table(
        expert_ids, num_experts, tiles.block_m, sorted_pairs=grouping.sorted_pair_ids,
        block_table=grouping.block_table, num_blocks=grouping.num_blocks, valid_rows=valid_rows,
    )  # fmt: skip
    return grouping


def _group_small(
    logits: torch.Tensor | None,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor | None,
    num_experts: int,
    tiles: MoeTiles,
    *,
    valid_rows: torch.Tensor | None,
) -> Grouping:
    """One program: top-k from ``logits`` (writing ids and weights) when given, then grouping
    (the tokens before ``valid_rows[0]``; None: all)."""
    num_tokens, top_k = expert_ids.shape
    grouping = _empty_grouping(expert_ids.numel(), num_experts, tiles.block_m, expert_ids.device)
    from_logits = logits is not None
    launcher(routing._route_small_kernel)[(1,)](
        logits if from_logits else expert_ids, expert_ids,
        routing_weights if from_logits else expert_ids,
        grouping.sorted_pair_ids, grouping.block_table, grouping.num_blocks,
        num_tokens, num_experts, grouping.max_blocks, valid_rows,
        TOP_K=top_k, K_PAD=_pow2(top_k), E_PAD=_experts_pad(num_experts),
        CHUNK_T=min(16, _pow2(num_tokens)), BLOCK_M=tiles.block_m, CHUNK_B=TABLE_CHUNK,
        FROM_LOGITS=from_logits, num_warps=4,
    )  # fmt: skip
    return grouping


def _empty_grouping(num_pairs: int, num_experts: int, block_m: int, device) -> Grouping:
    # Σ_e ceil(c_e / BM) ≤ P // BM + (number of experts used) ≤ P // BM + min(E, P).
    max_blocks = num_pairs // block_m + min(num_experts, num_pairs)
    return Grouping(
        sorted_pair_ids=torch.empty(num_pairs, dtype=torch.int32, device=device),
        block_table=torch.empty(3, max_blocks, dtype=torch.int32, device=device),
        num_blocks=torch.empty(1, dtype=torch.int32, device=device),
    )


def _experts(
    x: torch.Tensor,
    weights: MoeWeights,
    routing_weights: torch.Tensor,
    grouping: Grouping,
    *,
    tiles: MoeTiles,
    alpha: float,
    limit: float,
    out: torch.Tensor | None,
    poison: bool,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The three GEMM-side launches: gate_up + SwiGLU, down, ordered top-k sum. The GEMMs
    see only the grouping's pairs; ``valid_rows`` zeroes the padding rows' sums."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the Triton MoE takes bf16 activations, got {x.dtype}")
    x = x.contiguous()
    num_tokens, hidden = x.shape
    top_k = routing_weights.shape[1]
    num_pairs, inter = num_tokens * top_k, weights.intermediate_size
    h = _scratch((num_pairs, inter), torch.bfloat16, x.device, poison)
    y = _scratch((num_pairs, hidden), torch.float32, x.device, poison)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    common = (grouping.sorted_pair_ids, grouping.block_table, grouping.num_blocks)
    max_blocks = grouping.max_blocks
    ptx = tiles.ptx_dequant and not _interpreting()
    _launch_gemm(
        gemm._gate_up_kernel,
        x, weights.gate_up_blocks, weights.gate_up_scales, weights.gate_up_bias, h, *common,
        2 * inter, max_blocks, top_k, alpha, limit, x.stride(0),
        *_weight_strides(weights.gate_up_blocks, weights.gate_up_scales), h.stride(0),
        block_m=tiles.block_m, gemm_tiles=tiles.gate_up, n=2 * inter, k=hidden,
        max_blocks=max_blocks, ptx=ptx, step_rows=weights.step_rows,
    )  # fmt: skip
    _launch_gemm(
        gemm._down_kernel,
        h, weights.down_blocks, weights.down_scales, weights.down_bias, routing_weights, y,
        *common, hidden, max_blocks, h.stride(0),
        *_weight_strides(weights.down_blocks, weights.down_scales), y.stride(0),
        block_m=tiles.block_m, gemm_tiles=tiles.down, n=hidden, k=inter, max_blocks=max_blocks,
        ptx=ptx, step_rows=weights.step_rows,
    )  # fmt: skip
    sum_pairs(y, out, top_k, valid_rows)
    return out


def _launch_gemm(
    kernel,
    *args,
    block_m: int,
    gemm_tiles: GemmTiles,
    n: int,
    k: int,
    max_blocks: int,
    ptx: bool,
    step_rows: int = 1,
) -> None:
    """Grid: max_blocks row blocks x cdiv(n, block_n) column tiles; dead row blocks exit."""
    grid = (max_blocks * triton.cdiv(n, gemm_tiles.block_n),)
    launcher(kernel)[grid](
        *args,
        K=k, BLOCK_M=block_m, BLOCK_N=gemm_tiles.block_n, BLOCK_K=gemm_tiles.block_k,
        SWAP_AB=gemm_tiles.swap_ab, PTX=ptx, INTERPRET=_interpreting(), LB=step_rows,
        num_warps=gemm_tiles.num_warps, num_stages=gemm_tiles.num_stages,
    )  # fmt: skip


def dequantize_mxfp4_triton(
    blocks: torch.Tensor, scales: torch.Tensor, *, ptx: bool = True, step_rows: int = 1
) -> torch.Tensor:
    """Debug: the GEMMs' in-register decode of [N, K/32, 16] blocks written out, bf16 [N, K].
    ``ptx`` picks the inline-PTX decode (ignored under the interpreter, which cannot run it);
    ``step_rows``: the blocks' layout (kernels/mxfp4_layout.py), whose padding to whole steps
    comes out as zero columns past the matrix's K."""
    num_rows, num_groups = scales.shape
    out = torch.empty(num_rows, num_groups * 32, dtype=torch.bfloat16, device=blocks.device)
    block_n, block_k = 16, 64
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(num_groups * 32, block_k))
    launcher(dequant._dequant_kernel)[grid](
        blocks, scales, out, num_rows, num_groups * 32, blocks.stride(0), scales.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, PTX=ptx and not _interpreting(), LB=step_rows,
    )  # fmt: skip
    return out


def _weight_strides(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    """(block expert, block row, scale expert, scale row) strides, in bytes (= elements)."""
    return blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1)


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device, poison: bool) -> torch.Tensor:
    if poison:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _experts_pad(num_experts: int) -> int:
    return max(16, _pow2(num_experts))  # tl.dot needs N ≥ 16 in the prefill router


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)
