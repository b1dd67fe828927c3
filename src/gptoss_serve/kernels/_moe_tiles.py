"""The decode-path MoE's launch shapes (_moe_small.py): ``DecodeTiles``, the table of them by
token count (``DECODE_TILES``, each row's measurements beside it), the card rule that keeps 5-8
tokens on the per-pair rows on an H100, and the router's bounds. bench/step_tiles.py varies
these module globals to time the whole step under other rows.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from gptoss_serve.kernels import _moe_columns as columns
from gptoss_serve.kernels import _moe_gemv as gemv

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
    per_step = ROUTER_X_VALUES // triton.next_power_of_2(num_tokens)
    return tiles.router_block_k or max(128, min(triton.next_power_of_2(hidden), per_step))


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
