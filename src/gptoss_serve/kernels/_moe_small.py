"""Host side of the GEMV-shaped MXFP4 MoE, the "decode path" (T ≤ DECODE_MAX_TOKENS, which now
reaches prefill chunks too): tiles, buffers, launches.

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

import dataclasses
import functools
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
from gptoss_serve.kernels.fast_launch import launcher
from gptoss_serve.kernels.moe import MoeWeights

# Largest T routed to this path by mxfp4_moe_triton: up to here (as far as measured) the
# grouped columns beat the grouped GEMMs (bench/moe_prefill_columns.py; moe_profile.py prints
# both paths per T).
DECODE_MAX_TOKENS = 8192
# Largest T of _router_kernel (every program holds all T tokens' activations: 13.6 / 30 /
# 48.8 us at 16 / 32 / 64 tokens on the H200); above it the router GEMM split over K
# (_moe_router_split.py) writes the routing and x in thread or tile order.
ROUTER_MAX_TOKENS = 16
ROUTER_SPLIT_K = 192  # columns of H per router program (2880 = 15 parts)
# The decode router's x tile a step, T_PAD x BLOCK_K values (DecodeTiles.router_block_k): its
# latency is its chain of loads, so it takes H in as few steps as this allows (one step, its
# weights loaded before the PDL wait, up to 4 tokens). 16k since v29, 4k before (one step only
# at 1 token, 1024 columns at 3-4 tokens, 256 at 9-16): the whole 120b step (bench/step_tiles.py,
# H200, PDL, 1k context), ms, 4k / 16k: batch 2 2.990-3.002 / 2.948-2.955 (8k context 3.151-3.156
# / 3.112-3.115), 3 3.625-3.642 / 3.576-3.579, 4 4.148-4.154 / 4.095-4.108, 8 5.864-5.900 /
# 5.756, 16 9.040-9.065 / 8.739 (at 16 tokens 2048 columns 8.847, at 8 tokens 4096 5.764).
ROUTER_X_VALUES = 16384


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shapes of the decode path (bench/moe_profile.py sweeps them). A GEMV tile has
    rows x split rows of 128 columns (16, 32 or 64 per warp); ``split`` cuts the K columns in
    parts that separate tile rows read in parallel, for more warps per weight row."""

    gate_up_rows: int = 32  # gate/up rows per program (even)
    gate_up_split: int = 2
    gate_up_warps: int = 2
    gate_up_stages: int = 4  # cp.async depth of the weight stream, in loop iterations
    gate_up_unroll: int = 1  # 128-column steps per iteration (64·unroll B of a row at once)
    down_rows: int = 8  # rows of H per program, for each of the k experts
    down_split: int = 2  # k · split ≤ 8 keeps one n8 MMA per k-step
    down_warps: int = 2
    down_stages: int = 4
    down_unroll: int = 1
    router_experts: int = 1  # experts per router program
    # Past ROUTER_MAX_TOKENS: tokens per program of the K-split router's finish (the parts'
    # sum, bias, top-k). 4 (16 before: its 12-15 parts' loads did not all fit in registers at
    # once; ncu at 64 tokens 7.7 us for its 4 programs), the same bits: the whole 120b step
    # (bench/step_tiles.py, H200) at batch 32 17.92-17.97 -> 17.85 ms, at batch 64 24.29-24.32
    # -> 24.23 ms (2 or 1 tokens: about as fast, other bits).
    router_finish_tokens: int = 4
    # The router's columns of H a step; None: ROUTER_X_VALUES // T_PAD (all of H in one step
    # up to 4 tokens, 2048 columns at 5-8, 1024 at 9-16)
    router_block_k: int | None = None
    # When the router takes all of H in one step: its weights are loaded before the PDL wait
    router_preload: bool = True
    # Past ROUTER_MAX_TOKENS (the K-split router): columns of H and tokens per program.
    router_split_k: int = ROUTER_SPLIT_K
    router_block_t: int = 32
    # The routing from the router's last program (once) rather than a top-4 in every gate_up
    # program: that tail costs the router ~2 us, which the GEMVs win back from T ~ 8 on.
    route_in_router: bool = True
    # group_columns with the one-launch router (up to ROUTER_MAX_TOKENS): its last program,
    # having written the routing, also groups the pairs by expert (no grouping launch)
    group_in_router: bool = False
    # Pairs grouped by expert (_moe_columns.py): each expert's rows decoded once for up to 8
    # pairs (the MMA's columns). The GEMV tiles are then gate_up_rows / down_rows rows (split
    # 1), with the same warps and stages; the routing must come from the router.
    group_columns: bool = False
    group_size: int = 8  # pairs per group (group_columns): the MMAs' columns, 8 to 256
    # group_columns: activations stored in the GEMV tile's column order (a plain [128, NC]
    # load per step) rather than thread order (4 contiguous 16-byte runs per thread, permuted
    # in registers)
    tile_order: bool = False
    # tile_order for wgmma (4+ warps, 16+ pairs a group, where Triton emits wgmma): the same
    # values in the column order of wgmma's register operand (_moe_gemv.ORDER_WGMMA)
    wgmma_order: bool = False
    # group_columns: each step's scales as aligned 32-bit words through the loop's cp.async
    # pipeline, not one step ahead by ld.global.nc (_moe_gemv._mxfp4_gemv)
    scale_words: bool = False
    # group_columns with tile_order: a group's program also multiplies the next group when
    # that is its expert's last with at most this many pairs (0: never), as extra MMA columns
    # of the same decoded tiles; that group's own program then returns at once
    # (_moe_columns._next_group_columns). Near T · k / E ≈ group_size about half the experts
    # overflow their first group by a few pairs, and a second group decodes every weight tile
    # again for them.
    next_group_columns: int = 0
    # Per-pair path without route_in_router: each gate_up warp runs the top-k on its own copy
    # of the token's logits, so its reductions need no barrier and few registers
    # (_moe_decode._token_slot_routing; 168 -> 80 registers a thread at T = 1)
    warp_topk: bool = False
    ptx: bool = True  # inline-PTX decode (GPU); False: the portable Triton one
    pdl: bool = False  # programmatic dependent launches (kernels/launch.py); GPU only
    # With pdl: the per-pair down GEMV / the router lets the next kernel launch at its start
    # rather than after its weight stream (programs waiting beside a stream can slow it:
    # gate_up 1.5x at T = 1, v3)
    down_early_dependents: bool = False
    router_early_dependents: bool = False

    def __post_init__(self) -> None:
        # Triton tiles are powers of two; a GEMV tile is at least one 16-row MMA.
        for name, rows in [
            ("gate_up_rows · gate_up_split", self.gate_up_rows * self.gate_up_split),
            ("down_rows · down_split", self.down_rows * self.down_split),
        ]:
            if rows & (rows - 1) or rows < (16 if name.startswith("gate") else 4):
                raise ValueError(f"{name} must be a power of two ≥ 16 (down: · k), got {rows}")
        if self.gate_up_rows < 2:
            raise ValueError("gate_up_rows must cover a (gate, up) pair")
        self._check_routing()
        if self.group_columns and not (
            self.route_in_router and self.gate_up_split == self.down_split == 1
            and self.down_rows >= 16 and not self.down_rows & (self.down_rows - 1)
            and self.gate_up_unroll == self.down_unroll == 1
        ):  # fmt: skip
            raise ValueError(
                "group_columns needs route_in_router, split 1, unroll 1 and down_rows a power "
                f"of two >= 16, got {self}"
            )
        if self.tile_order and not self.group_columns:
            raise ValueError(f"tile_order is a group_columns option, got {self}")
        if self.wgmma_order and not self.tile_order:
            raise ValueError(f"wgmma_order is a tile_order option, got {self}")
        if self.scale_words and not self.group_columns:
            raise ValueError(f"scale_words is a group_columns option, got {self}")
        extra = self.next_group_columns
        if extra and not (
            self.tile_order and extra in columns.GROUP_SIZES and 16 <= extra < self.group_size
        ):
            raise ValueError(
                "next_group_columns needs tile_order and a group size in GROUP_SIZES, at least "
                f"16 and below group_size, got {self}"
            )
        # Groups of 64 on 16 rows a warp (64 rows of 4 warps, 128 of 8) gave wrong results now
        # and then on the H200 (Triton 3.6; bench/RESULTS.md v7b), where 32 rows a warp and
        # other group sizes passed every run: refused until understood.
        for rows, warps in ((self.gate_up_rows, self.gate_up_warps),
                            (self.down_rows, self.down_warps)):  # fmt: skip
            if self.wgmma_order and self.group_size == 64 and rows // warps < 32:
                raise ValueError(f"wgmma tiles with groups of 64 need 32+ rows a warp, got {self}")
        if self.group_size not in columns.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {columns.GROUP_SIZES}, got {self}")

    def _check_routing(self) -> None:
        finish = self.router_finish_tokens
        if finish < 1 or finish & (finish - 1):
            raise ValueError(f"router_finish_tokens must be a power of two, got {finish}")
        if self.warp_topk and self.route_in_router:
            raise ValueError(f"warp_topk is gate_up's own top-k: not with route_in_router, {self}")

    @property
    def topk_copies(self) -> int:
        """gate_up's WARP_TOPK: its warps (each its own copy of the logits), 0 without it."""
        return self.gate_up_warps if self.warp_topk else 0

    @property
    def order(self) -> int:
        """The activations' order, as the kernels' TILE_ORDER (_moe_gemv.ORDER_*)."""
        if self.wgmma_order:
            return gemv.ORDER_WGMMA
        return gemv.ORDER_MMA if self.tile_order else gemv.ORDER_THREAD


# The grouped-columns rows' common tiles: 64 rows unsplit for both GEMVs, 2 warps, 4 stages.
_COLUMNS = DecodeTiles(
    group_columns=True, gate_up_rows=64, gate_up_split=1, down_rows=64, down_split=1,
    down_warps=2,
)  # fmt: skip

# ... and past 128 tokens: 128-row tiles of 4 warps on wgmma, in its tile order, scale words.
_WGMMA_COLUMNS = dataclasses.replace(
    _COLUMNS, gate_up_rows=128, down_rows=128, gate_up_warps=4, down_warps=4, tile_order=True,
    wgmma_order=True, scale_words=True,
)  # fmt: skip

# ... and past 1024 tokens, 3 stages, and the K-split router takes 64 tokens and 768 columns a
# program (32 and 192 below): 77 -> 45 us a layer at 8192 tokens, 20.8 -> 19.4 at 2048 (v12,
# moe_prefill_tiles.py; other sums over K: the logits' last bits, so near-ties may route
# otherwise).
_PREFILL_COLUMNS = dataclasses.replace(
    _WGMMA_COLUMNS, gate_up_stages=3, down_stages=3, router_block_t=64, router_split_k=768
)

# By token count (first entry with T ≤ its bound), from bench/moe_profile.py on the H200 (v2,
# d6597e1: its "best tiles" at T = 1, 4, 16). At T = 1 the K split gives the SMs enough warps
# (gate_up 1440, down 1440 at 120b shapes, all resident at once); more tokens bring their own.
# Since v8, 3 cp.async stages rather than 4 in the rows up to 128 tokens (T = 8: down only):
# a fourth stage's shared memory cost residency (moe_layout_probe.py: 6 stages pushed the grid
# to two waves), and the whole 120b decode step (PDL, CUDA graph) at batch 1 / 4 / 16 / 32 /
# 64 went 2.518 / 6.079 / 13.448 / 17.087 / 23.313 -> 2.475 / 5.941 / 13.069 / 16.845 /
# 23.012 ms; 2 stages lose (batch 1 2.540, batch 64 24.604). At T = 1 gate_up also takes
# 64-row parts on 4 warps (alone, routed: 19.56 -> 18.36 us); its own top-4 stays in gate_up
# (the router's last program doing it: 2.822 ms a step).
# Since v16 each gate_up warp of the 1-token and 3-8-token rows runs the top-4 on its own copy
# of the logits (warp_topk): 10 reductions across the program's warps had set its registers
# (168 -> 80 at T = 1), and 4 warps then pay at 3-4 tokens. Whole 120b step (step_tiles.py,
# H100, logits the same bits at T = 1): batch 1 2.667 -> 2.609 ms, 3 5.056 -> 4.751, 4 5.780 ->
# 5.414; at batch 2 the 4 warps lost (3.658 -> 3.696; warps alone 3.815), so T = 2 keeps its row.
# Since v27 (H200, the whole step as the engine launches it, PDL; step_tiles.py) gate_up splits
# each row's K in 4 parts at 1 and 3-4 tokens (twice the bytes a thread has in flight a step,
# the same 360 programs), at 1 token on 2 stages: batch 1 1k 2.182-2.198 -> 2.133-2.138 ms, 8k
# 2.283-2.303 -> 2.248-2.250, batch 3 / 4 3.676-3.686 / 4.195-4.216 -> 3.634-3.636 / 4.148-4.163.
# At 2 tokens gate_up on 2 stages: 3.118-3.144 -> 3.059-3.075. (4 parts on 3 stages at 1
# token 2.177-2.179; 2 stages alone 2.214; at 2 tokens 4 parts lost, 3.14-3.32.)
# Since v28 down lets the next kernels launch at its start at 1-2 tokens (its 360-720
# programs are all resident, and the norm and q/k/v after it load their gains and weights
# beside its stream; q/k/v's had waited for down's loop to end), and at 1 token the router
# too: whole step batch 1 1k 2.133-2.135 -> 2.096-2.103 ms, 8k 2.240-2.246 -> 2.203-2.219,
# batch 2 3.023-3.030 -> 2.985-2.995. At 3-4 tokens down's early start lost (3.63 -> 3.69,
# 4.14 -> 4.26), so did the router's at 2 (2.98 -> 3.16) and gate_up's at 1 (2.13 -> 2.52).
DECODE_TILES: tuple[tuple[int, DecodeTiles], ...] = (
    (1, DecodeTiles(gate_up_rows=64, gate_up_split=4, gate_up_warps=4, gate_up_stages=2,
                    down_warps=4, down_stages=3, route_in_router=False, warp_topk=True,
                    down_early_dependents=True, router_early_dependents=True)),
    (2, DecodeTiles(gate_up_rows=64, gate_up_stages=2, down_rows=16, down_warps=4,
                    down_stages=3, route_in_router=False, down_early_dependents=True)),
    # 3-4 tokens; on an H100 5-8 tokens too (PER_PAIR_MAX_TOKENS_BY_CARD). Since v29 the
    # routing from the router's last program (its one step since e084d5e), not a top-4 in
    # every gate_up warp: H200, whole step, ms, batch 3 3.568-3.576 -> 3.541 / 3.545, 4
    # 4.106-4.126 -> 4.061 / 4.069 (at 1 and 2 tokens it lost: 2.114-2.121 -> 2.171, 2.945-
    # 2.963 -> 3.201 / 3.207). Not measured on an H100.
    (4, DecodeTiles(gate_up_rows=64, gate_up_split=4, gate_up_warps=4, gate_up_stages=3,
                    down_rows=16, down_warps=4, down_stages=3)),
    # From 5 tokens (9 on an H100) the pairs grouped by expert (_moe_columns.py). From 17 tokens
    # since v5: gate_up + down at 32 tokens 563 -> 484 us, at 64 tokens 1,080 -> 682 us (H200). From
    # 5 since v14, once a group's unused MMA columns were no longer read: the whole 120b step
    # (bench/step_tiles.py, H200) at batch 2 / 4 / 6 / 8 / 16 3.404 / 4.907 / 6.256 / 7.304 / 12.43
    # ms on the per-pair rows (T = 8 had its own: gate_up unrolled 2 on 2 stages) against 3.748 /
    # 4.855 / 5.965 / 6.945 / 10.502 grouped. 64-row tiles for both (2 warps, 4 stages), from
    # moe_profile.py's columns sweep: the whole MoE at 24 / 32 / 64 tokens 455 / 530 / 745 -> ~415 /
    # 470 / 651 us against 32-row tiles. Up to 128 tokens (large decode batches) groups of 8 on
    # mma.sync; since v7b with the activations in tile order and the scales as words (H200,
    # moe_prefill_columns.py --small, us per layer): 24 / 32 / 48 / 64 / 96 / 128 tokens 372 / 435 /
    # 522 / 560 / 632 / 660 -> 353 / 425 / 502 / 548 / 606 / 627 (2-5%; the words alone, in thread
    # order, lose 2-9%). Since v14 in the wgmma tile order on mma.sync (kWidth 2:
    # _moe_gemv._weight_tile), once the unused MMA columns were no longer read: 32 / 64 tokens +1-2%
    # (kernels.py, alternating; before that change it moved nothing, v13).
    # Since v29 the router's last program groups the pairs at 5-16 tokens (group_in_router: no
    # grouping launch; whole step, H200, PDL, ms, apart / in the router: batch 5 4.543-4.552 /
    # 4.521-4.528, 8 5.693-5.698 / 5.687-5.691, 16 8.556-8.567 / 8.542-8.544).
    (128, dataclasses.replace(
        _COLUMNS, tile_order=True, scale_words=True, gate_up_stages=3, down_stages=3,
        wgmma_order=True, group_in_router=True,
    )),
    # Past 128 tokens, wgmma: 128-row tiles of 4 warps in the wgmma tile order
    # (_moe_gemv.ORDER_WGMMA: the decoded weights are wgmma's register operand as they are),
    # each step's scales through the cp.async pipeline (scale_words). H200, one layer, us
    # (bench/RESULTS.md v7, v7b): 192 / 256 / 320 / 384 tokens, groups of 16, 4 stages: 686
    # / 696 / 721 / ~775 (the mma.sync row before, groups of 16 on 64-row tiles of 2 warps:
    # 929 / 846 / 870 / ~970); 512 / 768 / 1024 tokens, groups of 32: 840 / 940 / 1,157 (the
    # mma.sync row before, groups of 32 on 64-row tiles of 2 warps: 1,273 at 512, 1,464 at
    # 1024); 2048 / 8192 tokens, groups of 64: 1,703 / 4,946 (the grouped GEMMs 2,751 /
    # 7,896). Groups of 128 or 8-warp tiles lost at every size measured then (v7; past 3584
    # tokens, both together now win: below).
    # From 385 tokens an expert's last group of up to 16 pairs rides as extra MMA columns on
    # its previous group's program (next_group_columns; v10: MoE prefill at 2048 tokens 235 /
    # 215 -> 304 / 275 TFLOP/s, 8192 350 / 328 -> 362 / 348, the whole decode step at batch
    # 1024 83.2 -> 76.2 ms, at 512 51.8 -> 51.6; an always-on extra MMA lost 13% at 8192).
    # Since v20 (each step two dots of 64 columns) the 385-1024 row takes 4 stages, not 3: H100,
    # one layer, 400 / 512 / 768 / 1024 tokens 801 / 811-817 / 911-912 / 968-985 -> 768 / 776
    # / 870 / 960 us (5 stages as 4; 4 stages even at 256, 2048 and 8192 tokens).
    (384, dataclasses.replace(_WGMMA_COLUMNS, group_size=16)),
    (1024, dataclasses.replace(_WGMMA_COLUMNS, group_size=32, next_group_columns=16)),
    # From 1025 tokens the prefill tiles (_PREFILL_COLUMNS: 3 stages, the wider K-split router).
    (2048, dataclasses.replace(_PREFILL_COLUMNS, group_size=64, next_group_columns=16)),
    # From 2049 tokens (T · k / E from 64 pairs an expert) the last group rides along up to 32
    # pairs: H100, one layer, us, the row above / this one (medians of 3 rounds, bench/RESULTS.md
    # v22): 2304 tokens 1,282-1,297 / 1,253; 2560 1,448-1,498 / 1,395; 3072 1,684-1,780 /
    # 1,673-1,717; 3584 1,969-2,003 / 1,913. At 1536 / 2048 it lost 2-3% / 1-2%.
    (3584, dataclasses.replace(_PREFILL_COLUMNS, group_size=64, next_group_columns=32)),
    # Past 3584 tokens groups of 128 on 128-row tiles of 8 warps (two warpgroups of 64 rows on
    # the same activation tile: half the decode per MMA column), an expert's last group of up
    # to 64 pairs as extra columns. Time goes with the MMA columns run, padding included (the
    # same layer with every expert given exactly T·k/E pairs is 12-16% faster at 2048 / 8192
    # tokens): 128-column groups pad more, so they pay only where experts hold several groups.
    # H100, one layer, us, the table before / this row (bench/RESULTS.md v21; the same bits):
    # 3072 tokens 1,641-1,765 / 1,778-1,784; 4096 2,225-2,258 / 2,128-2,163; 6144 3,218-3,303
    # / 3,017-3,027; 8192 4,212-4,414 / 3,817-4,015. With 32 extra columns 3,967 at 8192, none
    # 4,152; on 2 stages 5,830 (one program an SM by registers either way).
    (DECODE_MAX_TOKENS, dataclasses.replace(
        _PREFILL_COLUMNS, group_size=128, gate_up_warps=8, down_warps=8, next_group_columns=64
    )),
)  # fmt: skip


def routes_in_router(tiles: DecodeTiles) -> bool:
    """Whether the router writes the routing (else gate_up computes it from the logits)."""
    return tiles.route_in_router


# Cards whose 5-8-token steps run faster on the per-pair GEMVs than on the grouped columns (a
# substring of the device name, the largest token count the per-pair rows then serve); other
# cards take the table as it is. The whole 120b decode step (bench/step_tiles.py, PDL, CUDA
# graph), per-pair rows against the grouped columns' row of 9-128 tokens, ms:
#   H100 (v16, c6745b3): batch 5 / 6 / 8  6.589 / 6.973 / 8.252 grouped -> 6.200 / 6.809 / 8.142
#   H200 (e30): batch 5 / 6 / 8  5.004-5.027 / 5.631-5.660 / 6.790-6.807 per-pair -> 4.810-4.812
#   / 5.111-5.112 / 6.040 grouped
# The H200 has ~1.4x the H100's memory bandwidth and the same SMs: there the per-pair GEMVs'
# extra instructions (each pair decodes its expert's rows again) cost more than the bytes the
# grouping saves them.
PER_PAIR_MAX_TOKENS_BY_CARD: tuple[tuple[str, int], ...] = (("H100", 8),)


def router_block_k(tiles: DecodeTiles, num_tokens: int, hidden: int) -> int:
    """The decode router's columns of H a step (``tiles.router_block_k``, or ROUTER_X_VALUES
    over the tokens' power of two, at most H's)."""
    return tiles.router_block_k or max(
        128, min(_pow2(hidden), ROUTER_X_VALUES // _pow2(num_tokens))
    )


@functools.cache
def _card_name(device_index: int | None) -> str:
    return torch.cuda.get_device_name(device_index)


def per_pair_max_tokens(device: torch.device | None) -> int:
    """The largest token count ``device``'s card keeps on the per-pair rows past the table's
    own (0: none; so for no device and for one that is not CUDA)."""
    if device is None or device.type != "cuda":
        return 0
    name = _card_name(device.index)
    return next((n for card, n in PER_PAIR_MAX_TOKENS_BY_CARD if card in name), 0)


def decode_tiles_for(num_tokens: int, device: torch.device | None = None) -> DecodeTiles:
    """The DECODE_TILES row serving ``num_tokens`` tokens, on ``device``'s card (None: the table
    as it is): up to the card's PER_PAIR_MAX_TOKENS_BY_CARD count the last per-pair row."""
    if num_tokens <= per_pair_max_tokens(device):
        per_pair = [(n, t) for n, t in DECODE_TILES if not t.group_columns]
        return next((t for n, t in per_pair if num_tokens <= n), per_pair[-1][1])
    return next((t for n, t in DECODE_TILES if num_tokens <= n), DECODE_TILES[-1][1])


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
        routed_here = routes_in_router(tiles) or num_tokens > ROUTER_MAX_TOKENS
        if groups_in_router(tiles, num_tokens):
            groups = group_buffers(num_tokens * top_k, weights.num_experts, tiles, device)
        launch_router(
            x, weights, logits, x_thread, tiles, ids=ids if routed_here else None, gates=gates,
            groups=groups, valid_rows=valid_rows,
        )  # fmt: skip
        if num_tokens > ROUTER_MAX_TOKENS:
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
    if num_tokens > ROUTER_MAX_TOKENS:
        if not route:
            raise ValueError(f"past {ROUTER_MAX_TOKENS} tokens the router must write the routing")
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
        and num_tokens <= ROUTER_MAX_TOKENS
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
