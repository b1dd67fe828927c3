"""Triton bodies of the decode-path MXFP4 GEMV: rows of one expert's packed weights times a few
activation columns, the weights decoded straight into the tensor cores' register operand.

Decode (T ≤ a few tokens) is a matrix-vector product: the tensor cores have time to spare and the
limits are HBM bandwidth and the instructions per weight byte. So the loop is built around the
byte stream, not around the MMA:

- A tile is BN weight rows x 128 columns (4 MXFP4 groups). Each of its 4·BN slots (row, group)
  belongs to one thread, which reads the group's 16 bytes with one 16-byte cp.async and its
  E8M0 scale with one byte load. Slot f = t + 4·g4 + 32·m16 + 2·BN·i1 is row 16·m16 + 8·i1 + g4,
  group t: lanes are (t, g4), warps and registers the rest, which is exactly how mma.sync's A
  fragment spreads rows and (with Triton's kWidth = 4) columns. So the decoded tile reaches the
  MMA with no shuffle and no shared-memory round trip, provided the tile's column order is the
  one below.
- The dot product is order-free, so the 32 elements of a thread's group are handed to the MMA
  in the order its decode produces them: element e = 8q + 2m + p + 4h (word q of the group,
  nibble a = 2m + p of the word's low half, h = 0, or of its high half, h = 1) is tile column
  k = 32q + 16m + 4t + 2p + h. The activations are stored in the matching "thread order"
  (``thread_order``): within every aligned block of 8, position j holds element swap02(j)
  (bits 0 and 2 exchanged, an involution). Then a thread's activations for one step are 4
  contiguous 16-byte runs. Or, for the grouped GEMVs, in that tile column order itself
  (``ORDER_MMA``: a step's [128, NC] activation tile is one plain load).
- With 4+ warps and 16+ columns Triton emits wgmma, whose register operand (kWidth 2) puts
  lane t on columns 2t and 2t+1 of each 16, where mma.sync's (kWidth 4) puts it on 4t..4t+3.
  ``ORDER_WGMMA`` numbers the same decoded values k = 32q + 16m + 8p + 2t + h, which is
  exactly the wgmma operand's layout: without it Triton moves every decoded weight between
  lanes (32 SHFL, 64 PRMT and 64 SEL per thread and step at 128 rows x 64 columns).
- In a tile order each step is two dots of 64 columns (words 0-1, then 2-3 of every slot):
  the same MMAs in the same order, half the decoded registers live at once (``_gemv_step``).
- Decode of a 32-bit word w (nibbles n0..n7): for the pair (n_a, n_a+4), 16 bits apart, one
  integer multiply places both nibbles' magnitude bits at bf16 bits 6-8 and their sign bits
  at bit 15 (low half) and 22-24 / 31 (high half): ((w & 0x000F000F) * 0x1040) & 0x81C081C0 for
  a = 0 (copies shifted by 6 and 12 do not overlap, so no carries), 0x104 for a = 1, and the
  same on w >> 8 for a = 2, 3. That bit pattern is the E2M1 value times 2^-126 (code 1, 0.5, is
  the bf16 subnormal 2^-127); one packed ``mul.rn.bf16x2`` by 2^(s-63) gives the weight times
  2^-62, exactly (subnormals are kept) for 64 ≤ s ≤ 190, i.e. |w| in [2^-64, 6·2^63]. The fp32
  accumulator is multiplied by 2^62 at the end. 17 instructions per 8 weights (1 SHF, 8 LOP3,
  4 IMAD, 4 HMUL2). The portable decode (interpreter, no PTX) builds the same bf16 bits through
  the fp16 placement of the old path (code · 2^-14, exact), so both are bit-identical.
- In the kernels' layout (step rows > 1; the engine's on CUDA) each word's bits come permuted
  at load (mxfp4_layout.permute_words) so that pair 0's fields already sit at those bits, pairs
  1 and 2 sit there rotated by 10 and 13, and pair 3 takes one multiply: 12 instructions per 8
  weights (``LB`` > 1; the portable decode undoes the permutation first). MoE prefill on the
  H100 at 2048 / 8192 tokens 321 / 373 -> 351-359 / 385-390 TFLOP/s; decode even (its loop is
  not bound by these instructions).
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import triton
import triton.language as tl

from gptoss_serve.kernels._moe_common import _dot, _prefetch_line
from gptoss_serve.kernels._word_bits import _unpermute
from gptoss_serve.kernels.mxfp4_layout import stored_groups

# Groups a row holds in blocks (and scales) stored in bands of LB rows, as a constexpr.
_stored_groups = triton.constexpr_function(stored_groups)

BLOCK_K = tl.constexpr(128)  # columns per step: 4 lanes x one 32-element MXFP4 group
# Activation orders (the TILE_ORDER constexpr of the kernels): thread order, or the tile's
# column order for mma.sync or for wgmma (module docstring).
ORDER_THREAD, ORDER_MMA, ORDER_WGMMA = 0, 1, 2
_WGMMA = tl.constexpr(ORDER_WGMMA)  # the same, where the kernels compare with it
ACC_SCALE = tl.constexpr(2.0**62)  # the decoded weights carry 2^-62 (module docstring)

# $8: a word (nibbles n0..n7), $9: the bf16x2 multiplier 2^(s-63) in both halves.
# ($2a, $2a+1) = (n_a, n_a+4) decoded, a = 0..3.
_DECODE_PTX = tl.constexpr(
    """
{
.reg .b32 v, x;
shr.b32 v, $8, 8;
and.b32 x, $8, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 x, x, $9; mov.b32 {$0, $1}, x;
and.b32 x, $8, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 x, x, $9; mov.b32 {$2, $3}, x;
and.b32 x, v, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 x, x, $9; mov.b32 {$4, $5}, x;
and.b32 x, v, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 x, x, $9; mov.b32 {$6, $7}, x;
}
"""
)


# The same for words in the permuted bit order of the kernels' layout (mxfp4_layout.py, step
# rows > 1): pair 0's fields are in place, pairs 1 and 2 rotated by 10 and 13 bits, pair 3's
# copied into place by one multiply. 12 instructions per 8 weights (8 without the scales).
_DECODE_PERMUTED_PTX = tl.constexpr(
    """
{
.reg .b32 x;
and.b32 x, $8, 0x81C081C0; mul.rn.bf16x2 x, x, $9; mov.b32 {$0, $1}, x;
shf.l.wrap.b32 x, $8, $8, 10; and.b32 x, x, 0x81C081C0; mul.rn.bf16x2 x, x, $9; mov.b32 {$2, $3}, x;
shf.l.wrap.b32 x, $8, $8, 13; and.b32 x, x, 0x81C081C0; mul.rn.bf16x2 x, x, $9; mov.b32 {$4, $5}, x;
and.b32 x, $8, 0x001B001B; mul.lo.u32 x, x, 0x1084; and.b32 x, x, 0x81C081C0;
mul.rn.bf16x2 x, x, $9; mov.b32 {$6, $7}, x;
}
"""
)


@triton.jit
def _tile_slots(BN: tl.constexpr):
    """(row in the tile [4·BN], group lane t [4·BN]) of the BN x 128 tile's slots."""
    f = tl.arange(0, 4 * BN)
    t = f % 4
    g4 = (f // 4) % 8
    m16 = (f // 32) % (BN // 16)
    i1 = f // (2 * BN)
    return 16 * m16 + 8 * i1 + g4, t


@triton.jit
def _slot_blocks(expert_blocks, row, first_group, G: tl.constexpr, LB: tl.constexpr):
    """Per slot, in one expert's [N, G, 16] blocks stored in step-major bands of LB rows padded
    to whole steps (kernels/mxfp4_layout.py; LB = 1: the checkpoint's rows): the pointer to
    group ``first_group`` (a multiple of 4 plus the lane t) of ``row``. It advances LB·64 bytes
    a step (``_mxfp4_gemv``'s LB)."""
    GS: tl.constexpr = _stored_groups(G, LB)
    band = (row // LB) * (LB * GS * 16)
    return (
        expert_blocks
        + band
        + (row % LB) * 64
        + (first_group // 4) * (LB * 64)
        + 16 * (first_group % 4)
    )


@triton.jit
def _nibble(words, SHIFT: tl.constexpr, scale):
    """Portable: the nibble at bit SHIFT of uint32 ``words`` times fp32 ``scale``, as bf16."""
    code = (words >> SHIFT) & 0xF
    half = ((code & 8) << 12) | ((code & 7) << 9)  # fp16 bits of code_value · 2^-14 (exact)
    value = half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    return value.to(tl.bfloat16)  # exact: a bf16 number times a power of two, in range


@triton.jit
def _decode_words(words, scale, PTX: tl.constexpr, PERMUTED: tl.constexpr = False):
    """words [R, 4] int32 (one group per row), scale [R] int32 (E8M0) -> 8 bf16 [R, 4]:
    output 2a + h is nibble a + 4h of each word times 2^(s - 127 - 62). PERMUTED: the words'
    bits are in the kernels' layout order (mxfp4_layout.permute_words)."""
    if PTX:
        mult = tl.broadcast_to(((scale + 64) * 0x00800080)[:, None], words.shape)
        return tl.inline_asm_elementwise(
            _DECODE_PERMUTED_PTX if PERMUTED else _DECODE_PTX,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [words, mult],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )
    w = words.to(tl.uint32, bitcast=True)
    if PERMUTED:
        w = _unpermute(w)
    # 2^(s - 189) (the 2^-62 of the tile) / 2^-14 (of the fp16 placement) = 2^(s - 175); s is
    # clamped to a positive fp32 exponent (exactness holds from s = 64 on anyway).
    f = (((tl.maximum(scale, 49) - 48) << 23).to(tl.float32, bitcast=True))[:, None]
    return (
        _nibble(w, 0, f), _nibble(w, 16, f), _nibble(w, 4, f), _nibble(w, 20, f),
        _nibble(w, 8, f), _nibble(w, 24, f), _nibble(w, 12, f), _nibble(w, 28, f),
    )  # fmt: skip


@triton.jit
def _weight_tile(words, scale, BN: tl.constexpr, PTX: tl.constexpr, ORDER: tl.constexpr = 0,
                 PERMUTED: tl.constexpr = False):  # fmt: skip
    """Decoded [BN, 32·Q] bf16 tile (Q words a slot: 4 is a whole step) in the column order of
    the module docstring (ORDER_WGMMA: the wgmma one, else mma.sync's)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _decode_words(words, scale, PTX, PERMUTED)
    tile = tl.join(
        tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7))
    )  # [4·BN, 4 q, 2 h, 2 p, 2 m]
    Q: tl.constexpr = words.shape[1]  # words a slot holds (4: the whole step)
    tile = tl.reshape(tile, [2, BN // 16, 8, 4, Q, 2, 2, 2])  # i1 m16 g4 t q h p m
    if ORDER == _WGMMA:
        tile = tl.permute(tile, (1, 0, 2, 4, 7, 6, 3, 5))  # m16 i1 g4 q m p t h
    else:
        tile = tl.permute(tile, (1, 0, 2, 4, 7, 3, 6, 5))  # m16 i1 g4 q m t p h
    tile = tl.reshape(tile, [BN, 32 * Q])
    if PTX and ORDER == _WGMMA:
        # An identity Triton cannot see through: its AccelerateMatmul halves the A operand's
        # bit width when a tl.join is in the operand's backward slice (the decode's), which
        # gives mma.sync kWidth 4, and then its B registers pair across two MMAs (33 moves a
        # warp-step). Past the identity mma.sync takes kWidth 2, whose A fragment is the
        # wgmma order's (lane t on columns 2t, 2t + 1): gate_up's loop at 64 tokens 431 -> 404
        # instructions a warp-step. Compiles to nothing on wgmma's own path (bench/RESULTS.md
        # v13, v14).
        tile = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [tile], dtype=tl.bfloat16,
                                         is_pure=False, pack=1)  # fmt: skip
    return tile


@triton.jit
def _activation_tile(col_ptrs, col_groups, step, MASK_K: tl.constexpr):
    """Step ``step`` (128 columns) of thread-ordered activation rows -> [128, NC] bf16 in the
    tile's column order; ``col_ptrs`` [NC] point at each column's first element, and column c
    has ``col_groups[c]`` valid 32-element groups from there."""
    t = tl.arange(0, 4)[None, :, None]
    ptrs = col_ptrs[:, None, None] + step * BLOCK_K + 32 * t + tl.arange(0, 8)[None, None, :]
    if MASK_K:
        mask = 4 * step + t < col_groups[:, None, None]
        x0 = tl.load(ptrs, mask=mask, other=0.0)  # [NC, 4 t, 8 j]
        x1 = tl.load(ptrs + 8, mask=mask, other=0.0)
        x2 = tl.load(ptrs + 16, mask=mask, other=0.0)
        x3 = tl.load(ptrs + 24, mask=mask, other=0.0)
    else:
        x0 = tl.load(ptrs)
        x1 = tl.load(ptrs + 8)
        x2 = tl.load(ptrs + 16)
        x3 = tl.load(ptrs + 24)
    xs = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [NC, 4 t, 8 j, 2 q0, 2 q1], j = 4p + 2m + h
    NC: tl.constexpr = col_ptrs.shape[0]
    xs = tl.reshape(xs, [NC, 4, 2, 2, 2, 2, 2])  # n t p m h q0 q1
    xs = tl.permute(xs, (6, 5, 3, 1, 2, 4, 0))  # q1 q0 m t p h n
    return tl.reshape(xs, [BLOCK_K, NC])


@triton.jit
def _activation_half(col_ptrs, col_groups, step, HALF: tl.constexpr):
    """Columns 64·HALF .. 64·HALF + 63 of step ``step`` of activation rows stored in the tile's
    column order (``tile_order``: ORDER_MMA or ORDER_WGMMA) -> [64, NC] bf16, a plain load.
    ``col_groups`` only masks whole columns: those with 0 groups (a group's unused MMA
    columns) are not read. The rows are zero past K (whole steps) and the weights there decode
    to 0, so no mask along k is needed (a masked load is vectorized only as far as its mask is
    constant: 4 bytes in the wgmma order)."""
    k = tl.arange(0, BLOCK_K // 2)[:, None] + HALF * (BLOCK_K // 2)
    # A mask constant along k keeps the 16-byte loads. At 64 tokens a group of 8 MMA columns
    # holds ~2.3 pairs, and reading the other columns' rows anyway cost the grouped columns
    # 5-12% (bench/RESULTS.md v14: L2 throughput was their limit).
    return tl.load(col_ptrs[None, :] + step * BLOCK_K + k, mask=(col_groups > 0)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _scale_words(scales_ptr, offsets):
    """The E8M0 bytes at ``offsets`` of ``scales_ptr`` (16-byte aligned) as (pointers to their
    aligned 32-bit words, bit shift of the byte in it): one slot's scales 4 bytes apart are
    then consecutive words with the same shift."""
    return scales_ptr.to(tl.pointer_type(tl.int32)) + (offsets >> 2), ((offsets & 3) * 8).to(
        tl.int32
    )


@triton.jit
def _load_scale(ptrs, mask, PTX: tl.constexpr):
    """E8M0 bytes [4·BN] -> int32 (0 where masked). On the GPU one ld.global.nc.u8 per slot
    through inline PTX: a tl.load would be vectorized by 2 (90-byte rows) into a layout that
    needs a shared-memory round trip and a barrier to reach the words' layout each step."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p ld.global.nc.u8 $0, [$1]; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _gemv_step(
    acc, scale, step, block_rows, scale_rows, row_groups, t, col_ptrs, col_groups,
    BN: tl.constexpr, MASK_K: tl.constexpr, PTX: tl.constexpr, INTERPRET: tl.constexpr,
    TILE_ORDER: tl.constexpr = 0, SCALE_WORDS: tl.constexpr = False, scale_shift=None,
    LB: tl.constexpr = 1, acc2=None, col_ptrs2=None, col_groups2=None,
):  # fmt: skip
    """One 128-column step; returns (acc, the next step's scales, acc2). LB: the blocks' step
    rows (kernels/mxfp4_layout.py): a row's consecutive steps are LB·64 bytes apart in
    ``block_rows`` (``_slot_blocks``; 64 in the checkpoint's rows), and past 1 each word's
    bits are in the kernels' permuted order.
    SCALE_WORDS: ``scale_rows`` are the scales' aligned 32-bit words and ``scale_shift`` the
    byte's bit offset in them (``_scale_words``), and this step's scale is read here, by a
    plain load the loop's pipeline issues stages ahead. ``col_ptrs2`` (tile order only): a
    second set of columns (``col_groups2`` as ``col_groups``), multiplied by the same decoded
    tile into ``acc2``."""
    PERMUTED: tl.constexpr = LB > 1
    byte_ptrs = block_rows + step * (LB * 64)
    word_ptrs = byte_ptrs.to(tl.pointer_type(tl.int32))
    word_ptrs = word_ptrs[:, None] + tl.arange(0, 4)[None, :]
    if MASK_K:
        words = tl.load(word_ptrs, mask=(4 * step + t < row_groups)[:, None], other=0)
    else:
        words = tl.load(word_ptrs)
    if SCALE_WORDS:  # byte 4·step + t of the row lies in word `step` from here
        if MASK_K:
            word = tl.load(scale_rows + step, mask=4 * step + t < row_groups, other=0)
        else:
            word = tl.load(scale_rows + step)
        next_scale = scale  # unused
        scale = (word >> scale_shift) & 0xFF
    else:
        next_mask = 4 * step + 4 + t < row_groups
        next_scale = _load_scale(scale_rows + 4 * step + 4, next_mask, PTX)
    if TILE_ORDER:
        # Two dots of 64 columns, each on the tile decoded from words 0-1 (then 2-3) of every
        # slot, rather than one of 128: the same MMAs in the same order (the same bits), half
        # the decoded registers live at once, and Triton then waits for the MMAs 5 times in
        # the grouped-columns kernels instead of 26. H100, one 120b layer (bench/RESULTS.md
        # v20): MoE at 8192 / 2048 / 1024 tokens 4,560-4,722 / 1,325-1,336 / 1,018-1,032 ->
        # 4,246 / 1,236 / 983 us (+8-11 / +7 / +4%), 16-512 tokens even to +3.5%. Four dots of
        # 32 columns lose 3-4x.
        halves = tl.split(tl.permute(tl.reshape(words, [words.shape[0], 2, 2]), (0, 2, 1)))
        for half in tl.static_range(2):
            tile = _weight_tile(halves[half], scale, BN, PTX, TILE_ORDER, PERMUTED)
            acc = _dot(tile, _activation_half(col_ptrs, col_groups, step, half), acc, INTERPRET)
            if col_ptrs2 is not None:
                acc2 = _dot(tile, _activation_half(col_ptrs2, col_groups2, step, half), acc2,
                            INTERPRET)  # fmt: skip
        return acc, next_scale, acc2
    tile = _weight_tile(words, scale, BN, PTX, 0, PERMUTED)
    acc = _dot(tile, _activation_tile(col_ptrs, col_groups, step, MASK_K), acc, INTERPRET)
    return acc, next_scale, acc2


@triton.jit
def _mxfp4_gemv(
    block_rows, scale_rows, row_groups, t, col_ptrs, col_groups,
    BN: tl.constexpr, STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, UNROLL: tl.constexpr,
    NUM_STAGES: tl.constexpr, PTX: tl.constexpr, INTERPRET: tl.constexpr,
    TILE_ORDER: tl.constexpr = 0, SCALE_WORDS: tl.constexpr = False, scale_shift=None,
    LB: tl.constexpr = 1, col_ptrs2=None, col_groups2=None,
):  # fmt: skip
    """(acc [BN, NC] fp32 = 2^-62 · W_rows @ X_cols^T over STEPS steps of 128 columns, acc2):
    with ``col_ptrs2`` [NC2] (tile order), acc2 [BN, NC2] is the same for those columns from
    the same decoded tiles, else a [1, 1] zero.

    Per slot (``_tile_slots``): ``block_rows`` points at its row's bytes of group t of its first
    step (u8), ``scale_rows`` at that group's scale, and the row has ``row_groups`` valid groups
    from its first one (0 for rows past the end). Per column, ``col_ptrs``/``col_groups`` the
    same for the thread-ordered activations (bf16). The first FULL_STEPS steps are valid for
    every row and column: when that is all of them, the loads carry no masks. UNROLL steps per
    iteration (STEPS a multiple of it): their loads go out together, so that HBM sees each
    row's 64·UNROLL contiguous bytes at once rather than 64 at a time. TILE_ORDER: the
    activations' order (ORDER_*; ``_activation_tile``), which also orders the weight tile; in
    a tile order every column pointer must point at a row whose padding past K is zeros
    (finite values only: the masked weights there decode to 0), as the router and gate_up
    write them, and ``col_groups`` (``col_groups2``) only masks whole columns. SCALE_WORDS:
    see ``_gemv_step``; the default reads each step's scales one step ahead by ld.global.nc,
    which is right for the bandwidth-bound decode (v4b), while wgmma's compute-bound tiles
    lose ~20% waiting on it behind their cp.async stream (bench/RESULTS.md v7b).
    LB: see ``_gemv_step``."""
    NC: tl.constexpr = col_ptrs.shape[0]
    acc = tl.zeros([BN, NC], tl.float32)
    if col_ptrs2 is None:
        acc2 = tl.zeros([1, 1], tl.float32)
    else:
        acc2 = tl.zeros([BN, col_ptrs2.shape[0]], tl.float32)
    if SCALE_WORDS:
        scale = tl.zeros_like(row_groups)  # each step reads its own
    else:
        if PTX:  # the scales are read one step ahead only: have all of them in L2 by then
            last = tl.minimum(row_groups, 4 * STEPS) - 1 - t  # this part's last scale, from here
            _prefetch_line(scale_rows + tl.maximum(last, 0), last > 0)
        scale = _load_scale(scale_rows, t < row_groups, PTX)
    # One pipelined loop, masked when some step is partial (K = 2880 is 22.5 steps; in the
    # padded bands with tile-order activations none is): a partial step peeled off the loop
    # would wait for its loads from HBM with nothing in flight.
    for step0 in tl.range(0, STEPS, UNROLL, num_stages=NUM_STAGES):
        for j in tl.static_range(UNROLL):
            acc, scale, acc2 = _gemv_step(
                acc, scale, step0 + j, block_rows, scale_rows, row_groups, t, col_ptrs,
                col_groups, BN, FULL_STEPS < STEPS, PTX, INTERPRET, TILE_ORDER, SCALE_WORDS,
                scale_shift, LB, acc2, col_ptrs2, col_groups2,
            )  # fmt: skip
    return acc, acc2


@triton.jit
def _decode_debug_kernel(blocks_ptr, scales_ptr, out_ptr, num_rows, PTX: tl.constexpr,
                         PERMUTED: tl.constexpr = False):  # fmt: skip
    """Debug: each row's first group ([N, 16] bytes, [N] scales; PERMUTED: the words' bits in
    the kernels' layout order) decoded into the 32 tile columns it feeds, in tile order (q, m,
    p, h) -> out [N, 32] bf16 (tests only)."""
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    mask = rows < num_rows
    words = tl.load(
        blocks_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * 4 + tl.arange(0, 4)[None, :],
        mask=mask[:, None],
        other=0,
    )
    scale = tl.load(scales_ptr + rows, mask=mask, other=127).to(tl.int32)
    o0, o1, o2, o3, o4, o5, o6, o7 = _decode_words(words, scale, PTX, PERMUTED)
    tile = tl.join(
        tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7))
    )  # [16, 4 q, 2 h, 2 p, 2 m]
    tile = tl.reshape(tl.permute(tile, (0, 1, 4, 3, 2)), [16, 32])  # (q, m, p, h)
    cols = tl.arange(0, 32)
    tl.store(out_ptr + rows[:, None] * 32 + cols[None, :], tile, mask=mask[:, None])
