"""The decode path of the MXFP4 MoE (T ≤ DECODE_MAX_TOKENS, _moe_small.py / _moe_decode.py:
router, GEMV gate_up, GEMV down + top-k sum): its in-register decode bit for bit, the launch
shapes of its tile table and variants, the routing written by the router or by gate_up, under
the interpreter (small ragged shapes) and on the GPU (120b/20b shapes). Tolerances: moe_cases.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from compare import assert_close, poisoned
from moe_cases import (
    INTERPRETING,
    MAX_REL,
    RMS_REL,
    SM90_POINTERS,
    assert_same_routing,
    check_against_reference,
    clear_tokens,
    compile_sm90,
    fresh_seed,
    interpreter,
    random_weights,
    random_x,
    reference_routing,
    router_constexprs,
    sm90_registers,
)

from gptoss_serve.kernels.moe import (
    MoeWeights,
    mxfp4_moe_experts_reference,
    mxfp4_moe_reference,
)
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from gptoss_serve.kernels.mxfp4_layout import permute_words


def check_decode_bit_exact(device: str, ptx_choices: tuple[bool, ...]) -> None:
    """The GEMV decode of every code in both nibbles under 52 scales and the edges of its exact
    range (64 ≤ s ≤ 190), plus random bytes, against the reference times 2^-62, in tile order."""
    from gptoss_serve.kernels._moe_small import decode_debug  # noqa: PLC0415

    codes = torch.arange(16, dtype=torch.uint8, device=device)
    one_block = codes | ((15 - codes) << 4)
    exponents = [*range(106, 158), 64, 65, 127, 189, 190]
    blocks = one_block.expand(len(exponents), 16).contiguous()
    scales = torch.tensor(exponents, dtype=torch.uint8, device=device)
    random_blocks = torch.randint(0, 256, (77, 16), dtype=torch.uint8, device=device)
    random_scales = torch.randint(100, 140, (77,), dtype=torch.uint8, device=device)
    column = torch.arange(32, device=device)  # tile column 8q + 4m + 2p + h: element 8q+2m+p+4h
    element = 8 * (column // 8) + 2 * (column // 4 % 2) + column // 2 % 2 + 4 * (column % 2)
    for b, sc in [(blocks, scales), (random_blocks, random_scales)]:
        values = dequantize_mxfp4(b[:, None, :], sc[:, None], torch.float32)[:, element]
        expected = (values * 2.0**-62).to(torch.bfloat16).view(torch.int16)
        for ptx in ptx_choices:
            actual = decode_debug(b, sc, ptx=ptx)
            assert torch.equal(actual.view(torch.int16), expected), f"ptx={ptx}"
            # The kernels' layout: the same values from the words' bits permuted.
            actual = decode_debug(permute_words(b), sc, ptx=ptx, permuted=True)
            assert torch.equal(actual.view(torch.int16), expected), f"permuted, ptx={ptx}"


def check_decode_routing(x: torch.Tensor, weights: MoeWeights, tiles=None) -> None:
    """The 3-launch path end to end: top-k ids and weights written by gate_up equal the fp32
    reference's on clear tokens, and so does the output."""
    from gptoss_serve.kernels._moe_small import mxfp4_moe_decode  # noqa: PLC0415

    out = poisoned(tuple(x.shape), torch.bfloat16, str(x.device))
    result = mxfp4_moe_decode(x, weights, tiles=tiles, out=out, poison=True)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert result.out is out
    assert_same_routing(result.expert_ids[clear], result.routing_weights[clear],
                        expected_ids[clear], expected_weights[clear])  # fmt: skip
    expected = mxfp4_moe_reference(x, weights)
    assert_close(result.out[clear], expected[clear], max_rel=MAX_REL, rms_rel=RMS_REL)


def _decode_variants() -> list:
    """Launch shapes the tests cover: the table's entries, a K split of 4, tiles that do not
    divide N (rows clamped), one warp per program, the portable decode, PDL, unrolled steps."""
    if importlib.util.find_spec("triton") is None:
        return []
    from gptoss_serve.kernels._moe_tiles import DECODE_TILES, DecodeTiles  # noqa: PLC0415

    return [tiles for _, tiles in DECODE_TILES] + [
        DecodeTiles(
            gate_up_rows=128,
            gate_up_split=1,
            gate_up_warps=4,
            down_rows=64,
            down_split=1,
            down_warps=8,
        ),
        DecodeTiles(gate_up_rows=16, gate_up_split=4, gate_up_warps=1, down_rows=4, down_warps=1),
        DecodeTiles(gate_up_rows=64, gate_up_split=1, router_experts=2, ptx=False),
        DecodeTiles(pdl=True),
        DecodeTiles(gate_up_stages=2, gate_up_unroll=4, down_stages=3, down_unroll=2),
        DecodeTiles(
            group_columns=True,
            gate_up_rows=16,
            gate_up_split=1,
            gate_up_warps=1,
            down_rows=16,
            down_split=1,
            down_warps=1,
        ),
    ]


@interpreter
@pytest.mark.parametrize(
    ("num_tokens", "group_size", "order", "scale_words", "extra"),
    [(1, 8, 0, False, 0), (20, 8, 0, False, 0), (80, 16, 0, False, 0), (1, 8, 1, False, 0),
     (20, 8, 1, False, 0), (80, 32, 1, False, 0), (20, 16, 2, False, 0), (80, 32, 2, True, 0),
     (20, 8, 0, True, 0), (100, 32, 2, True, 16), (100, 32, 1, False, 16), (5, 8, 2, True, 0)],
)  # fmt: skip
def test_interpreter_grouped_columns(
    num_tokens: int, group_size: int, order: int, scale_words: bool, extra: int
) -> None:
    """Pairs grouped by expert: 20 tokens over 8 experts put ~10 pairs on an expert, so an
    expert takes two groups of 8 columns; 80 tokens (320 pairs) are routed by the K-split
    router, ~40 pairs an expert in groups of 16 or 32; activations in thread order (0) or a
    tile order (1: mma.sync's, 2: wgmma's); the scales one step ahead or as aligned words
    (H = 160: rows of 5 scale bytes, so most rows' scales start mid-word); an expert's short
    last group taken as 16 extra columns by its previous group's program (``extra``: at 100
    tokens the experts hold 42-58 pairs, so 3 overflow 32 by at most 16 and 5 by more).
    Poisoned scratch, the kernels' own routing (up to 16 tokens the decode router writes x in
    the tile order, past 16 the K-split router)."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    tiles = _moe_small.DecodeTiles(
        group_columns=True, group_size=group_size, gate_up_rows=32, gate_up_split=1,
        down_rows=16, down_split=1, tile_order=order > 0, wgmma_order=order == 2,
        scale_words=scale_words, next_group_columns=extra,
    )  # fmt: skip
    check_decode_routing(random_x(num_tokens, 160, seed=41), random_weights(8, 160, 96, seed=40),
                         tiles)  # fmt: skip


def check_groups(device: str, num_pairs: int, num_experts: int, group_size: int, seed: int):
    """_group_kernel's table equals the torch reference's for a random routing, skewed so that
    some experts take several groups and others none."""
    from gptoss_serve.kernels import _moe_columns, _moe_small  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_experts, generator=generator) ** 3
    ids = torch.multinomial(weights, num_pairs, replacement=True, generator=generator)
    ids = ids.to(torch.int32).reshape(-1, 4).to(device)
    tiles = _moe_small.DecodeTiles(
        group_columns=True, group_size=group_size, gate_up_split=1, down_rows=16, down_split=1
    )
    g_max = _moe_columns.max_groups(num_pairs, num_experts, group_size)
    group_expert, group_pairs = _moe_small.group(ids, num_experts, tiles)
    expected = _moe_columns.groups_reference(ids, num_experts, group_size, g_max)
    assert torch.equal(group_expert.cpu(), expected[0])
    assert torch.equal(group_pairs.cpu(), expected[1])


@interpreter
@pytest.mark.parametrize(("num_pairs", "group_size"), [(4, 8), (40, 8), (256, 8), (1536, 16)])
def test_interpreter_groups(num_pairs: int, group_size: int) -> None:
    check_groups("cpu", num_pairs, 128, group_size, seed=num_pairs)


def check_table_groups(device: str, num_pairs: int, group_size: int, seed: int) -> None:
    """Past SORT_MAX_PAIRS, the count / block table / scatter grouping: the same experts per
    group as the reference, the same number of pairs in each group and the same pairs on each
    expert (the scatter's atomics may deal an expert's pairs to its groups in another order,
    which changes no value)."""
    from gptoss_serve.kernels import _moe_columns, _moe_small  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(128, generator=generator) ** 3
    ids = torch.multinomial(weights, num_pairs, replacement=True, generator=generator)
    ids = ids.to(torch.int32).reshape(-1, 4).to(device)
    tiles = _moe_small.DecodeTiles(
        group_columns=True, group_size=group_size, gate_up_split=1, down_rows=16, down_split=1
    )
    assert num_pairs > _moe_columns.SORT_MAX_PAIRS
    group_expert, group_pairs = _moe_small.group(ids, 128, tiles)
    g_max = _moe_columns.max_groups(num_pairs, 128, group_size)
    expected = _moe_columns.groups_reference(ids, 128, group_size, g_max)
    assert torch.equal(group_expert.cpu(), expected[0])
    group_pairs = group_pairs.cpu()
    assert torch.equal((group_pairs >= 0).sum(1), (expected[1] >= 0).sum(1))
    for expert in range(128):
        mine, theirs = group_pairs[expected[0] == expert], expected[1][expected[0] == expert]
        assert torch.equal(mine[mine >= 0].sort().values, theirs[theirs >= 0].sort().values)


@interpreter
def test_interpreter_table_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    from gptoss_serve.kernels import _moe_columns  # noqa: PLC0415

    monkeypatch.setattr(_moe_columns, "SORT_MAX_PAIRS", 64)
    check_table_groups("cpu", 300, 16, seed=3)


@interpreter
def test_interpreter_grouped_columns_by_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped columns end to end with their groups from the block table (wgmma order,
    groups of 32: 200 tokens put ~100 pairs on each of 8 experts)."""
    from gptoss_serve.kernels import _moe_columns, _moe_small  # noqa: PLC0415

    monkeypatch.setattr(_moe_columns, "SORT_MAX_PAIRS", 64)
    tiles = _moe_small.DecodeTiles(
        group_columns=True, group_size=32, gate_up_rows=32, gate_up_split=1, down_rows=16,
        down_split=1, tile_order=True, wgmma_order=True, scale_words=True,
    )  # fmt: skip
    check_decode_routing(random_x(200, 160, seed=43), random_weights(8, 160, 96, seed=42),
                         tiles)  # fmt: skip


def check_split_router(x: torch.Tensor, weights: MoeWeights, split_k: int, order: int = 0) -> None:
    """The K-split router: top-k ids and weights equal the fp32 reference's on clear tokens,
    and x_thread is x in thread order (or a tile order, zero padded), bit for bit."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    num_tokens, hidden = x.shape
    ids = torch.full((num_tokens, 4), -7, dtype=torch.int32, device=x.device)
    gates = poisoned((num_tokens, 4), torch.float32, str(x.device))
    width = _moe_small.row_width(hidden, order > 0)
    x_thread = poisoned((num_tokens, width), torch.bfloat16, str(x.device))
    _moe_small._launch_wide_router(x, weights, x_thread, ids, gates, split_k=split_k, order=order)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert_same_routing(ids[clear], gates[clear], expected_ids[clear], expected_weights[clear])
    expected = _moe_small.tile_order(x, order) if order else _moe_small.thread_order(x)
    assert torch.equal(x_thread, expected)


@interpreter
def test_split_router_refuses_short_tile_rows() -> None:
    """Tile order pads rows to whole 128-column steps: a [T, H] x_thread is refused, not
    written past its rows."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    x, weights = random_x(20, 160), random_weights(8, 160, 96)
    ids, gates = torch.empty(20, 4, dtype=torch.int32), torch.empty(20, 4)
    with pytest.raises(ValueError, match="whole 128-steps"):
        _moe_small._launch_wide_router(x, weights, torch.empty_like(x), ids, gates, order=1)


def check_decode_router(
    x: torch.Tensor, weights: MoeWeights, order: int, block_k: int | None = None
) -> None:
    """The decode router (up to 16 tokens) for the grouped rows: the routing equals the fp32
    reference's on clear tokens, and x_thread is x in the tile order ``order``, zero padded to
    whole 128-column steps, bit for bit (a poisoned buffer: every position is written);
    ``block_k``: the router's columns a step (None: the launcher's choice)."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    num_tokens, hidden = x.shape
    tiles = dataclasses.replace(
        _moe_small.decode_tiles_for(16), wgmma_order=order == 2, router_block_k=block_k
    )
    assert tiles.tile_order and tiles.order == order
    ids = torch.full((num_tokens, 4), -7, dtype=torch.int32, device=x.device)
    gates = poisoned((num_tokens, 4), torch.float32, str(x.device))
    logits = poisoned((num_tokens, weights.num_experts), torch.float32, str(x.device))
    x_thread = poisoned((num_tokens, _moe_small.row_width(hidden, True)), torch.bfloat16,
                        str(x.device))  # fmt: skip
    _moe_small.launch_router(x, weights, logits, x_thread, tiles, ids=ids, gates=gates)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert_same_routing(ids[clear], gates[clear], expected_ids[clear], expected_weights[clear])
    assert torch.equal(x_thread, _moe_small.tile_order(x, order))
    with pytest.raises(ValueError, match="whole 128-steps"):  # [T, H] rows are too short
        _moe_small.launch_router(x, weights, logits, torch.empty_like(x), tiles, ids=ids,
                                 gates=gates)  # fmt: skip


@interpreter
@pytest.mark.parametrize(("num_tokens", "order", "block_k"), [(5, 1, None), (5, 2, None),
                                                              (16, 2, 128)])  # fmt: skip
def test_interpreter_decode_router_tile_order(num_tokens: int, order: int, block_k) -> None:
    """H = 160: two steps, the second mostly padding; x in one 256-column chunk (the
    launcher's BLOCK_K here), or in 128-column chunks that two programs write."""
    x, weights = random_x(num_tokens, 160, seed=61), random_weights(8, 160, 96, seed=60)
    check_decode_router(x, weights, order, block_k)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "order"), [(5, 2), (8, 1), (16, 2)])
def test_gpu_decode_router_tile_order(gpu_weights: MoeWeights, num_tokens: int, order: int):
    check_decode_router(random_x(num_tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights,
                        order)  # fmt: skip


@interpreter
def test_interpreter_split_router() -> None:
    """40 tokens (two blocks of 32, the second ragged), H = 160 in parts of 64 (the last
    part half masked); in tile order parts of 128, the second one mostly padding."""
    x, weights = random_x(40, 160, seed=51), random_weights(8, 160, 96, seed=50)
    check_split_router(x, weights, 64)
    check_split_router(x, weights, 64, order=1)  # parts of 128: two steps
    check_split_router(x, weights, 64, order=2)


@interpreter
def test_interpreter_decode_bit_exact() -> None:
    check_decode_bit_exact("cpu", (False,))


@interpreter
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_interpreter_decode_matches_reference(num_tokens: int, variant: int) -> None:
    """H = 160 (5 groups: a partial step), 2I = 192; given routing, poisoned buffers."""
    from gptoss_serve.kernels._moe_small import mxfp4_moe_decode  # noqa: PLC0415

    weights = random_weights(8, 160, 96, seed=20 + num_tokens)
    x = random_x(num_tokens, 160, seed=variant)
    expert_ids, routing_weights = reference_routing(x, weights)
    out = poisoned(tuple(x.shape), torch.bfloat16, "cpu")
    mxfp4_moe_decode(
        x, weights, tiles=_decode_variants()[variant], out=out, poison=True,
        expert_ids=expert_ids, routing_weights=routing_weights,
    )  # fmt: skip
    expected = mxfp4_moe_experts_reference(x, weights, expert_ids, routing_weights)
    assert_close(out, expected, max_rel=MAX_REL, rms_rel=RMS_REL)


def check_topk(device: str) -> None:
    """The top-k against a stable descending sort (exact ties to the lowest id):
    ties, negative and zero logits of both signs, -inf, a padded expert count."""
    from gptoss_serve.kernels._moe_routing import _topk_debug_kernel  # noqa: PLC0415

    rows = [
        torch.randn(128),
        torch.tensor([1.0, 3.0, 3.0, -2.0, 3.0, 0.5, 3.0, 1.0] * 16),  # 4-way ties, repeated
        -torch.rand(128) - 1.0,  # all negative
        torch.tensor([-0.0, 0.0, -1.0, -0.0, -2.0, 0.0, -3.0, -5.0] * 16),  # zeros of both signs
        torch.cat([torch.full((120,), float("-inf")), torch.randn(8)]),
    ]
    for num_experts, rows_of_logits in [(128, torch.stack(rows)), (100, torch.randn(3, 100))]:
        logits = rows_of_logits.to(device)
        ids = torch.empty(logits.shape[0], 4, dtype=torch.int32, device=device)
        weights = torch.empty(logits.shape[0], 4, dtype=torch.float32, device=device)
        _topk_debug_kernel[(logits.shape[0],)](logits, ids, weights, E=num_experts, TOP_K=4)
        # Stable sort of (logit + 0.0): -0.0 and +0.0 are one value, as for the kernel.
        order = torch.sort(logits + 0.0, dim=1, descending=True, stable=True).indices[:, :4]
        assert torch.equal(ids.long(), order)
        expected = torch.softmax(logits.gather(1, order), dim=1)
        assert_close(weights, expected, max_rel=1e-6, rms_rel=1e-6)


@interpreter
def test_interpreter_topk() -> None:
    check_topk("cpu")


@pytest.mark.gpu
def test_gpu_topk() -> None:
    check_topk("cuda")


@interpreter
def test_interpreter_decode_routing() -> None:
    check_decode_routing(random_x(6, 96, seed=31), random_weights(8, 96, 64, seed=30))


@pytest.mark.gpu
def test_gpu_decode_bit_exact() -> None:
    check_decode_bit_exact("cuda", (True, False))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 8, 9, 16, 100, "max", "max+1"])
def test_gpu_decode_matches_reference(gpu_weights: MoeWeights, num_tokens) -> None:
    """Through moe_experts_triton's dispatch, up to and just past the switch to the grouped
    path (DECODE_MAX_TOKENS)."""
    from gptoss_serve.kernels._moe_tiles import DECODE_MAX_TOKENS  # noqa: PLC0415

    tokens = {"max": DECODE_MAX_TOKENS, "max+1": DECODE_MAX_TOKENS + 1}.get(num_tokens, num_tokens)
    check_against_reference(random_x(tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "shape", "scale_words", "extra"),
    [(600, (32, 128, 8, 3), True, 0), (600, (32, 128, 8, 3), False, 0),
     (2048, (64, 128, 4, 3), True, 0), (2048, (64, 128, 4, 3), False, 0),
     (3000, (128, 128, 8, 2), True, 0), (600, (32, 128, 8, 3), True, 16),
     (2048, (64, 128, 4, 3), True, 16), (1000, (32, 128, 4, 3), True, 16),
     (5000, (128, 128, 8, 3), True, 64), (4000, (128, 128, 8, 3), True, 0),
     (3000, (64, 128, 4, 3), True, 32), (2300, (64, 128, 4, 3), True, 32)],
)  # fmt: skip
def test_gpu_wgmma_columns_match_reference(
    gpu_weights: MoeWeights, num_tokens: int, shape: tuple, scale_words: bool, extra: int
) -> None:
    """The grouped columns on wgmma tiles (group size, rows, warps, stages), in the wgmma tile
    order, the scales one step ahead or as words, an expert's short last group as extra
    columns or not, with the fp32 routing given, into poisoned scratch: past 4096 pairs the
    groups come from the block table."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415
    from gptoss_serve.kernels._moe_triton import moe_experts_triton  # noqa: PLC0415

    cols, rows, warps, stages = shape
    tiles = dataclasses.replace(
        _moe_small.decode_tiles_for(2048), group_size=cols, gate_up_rows=rows, down_rows=rows,
        gate_up_warps=warps, down_warps=warps, gate_up_stages=stages, down_stages=stages,
        scale_words=scale_words, next_group_columns=extra,
    )  # fmt: skip
    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    expert_ids, routing_weights = reference_routing(x, gpu_weights)
    out = poisoned(tuple(x.shape), torch.bfloat16, "cuda")
    actual = moe_experts_triton(
        x, gpu_weights, expert_ids, routing_weights, out=out, poison=True, decode_tiles=tiles
    )
    expected = mxfp4_moe_experts_reference(x, gpu_weights, expert_ids, routing_weights)
    assert_close(actual, expected, max_rel=MAX_REL, rms_rel=RMS_REL)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_next_group_columns_are_checked() -> None:
    """Extra columns need the tile order and a group size of 16+ below the group's."""
    from gptoss_serve.kernels._moe_small import DecodeTiles, decode_tiles_for  # noqa: PLC0415

    tiles = decode_tiles_for(2048)
    for extra in (8, 24, 64, 128):
        with pytest.raises(ValueError, match="next_group_columns"):
            dataclasses.replace(tiles, next_group_columns=extra)
    with pytest.raises(ValueError, match="next_group_columns"):
        DecodeTiles(group_columns=True, gate_up_split=1, down_rows=16, down_split=1,
                    group_size=32, next_group_columns=16)  # fmt: skip
    assert dataclasses.replace(tiles, next_group_columns=32).next_group_columns == 32


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_wgmma_groups_of_64_need_32_rows_a_warp() -> None:
    """The tile shapes that gave wrong results now and then on the H200 are refused."""
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    base = _moe_small.decode_tiles_for(2048)
    with pytest.raises(ValueError, match="32\\+ rows a warp"):
        dataclasses.replace(base, gate_up_rows=64, down_rows=64)
    with pytest.raises(ValueError, match="32\\+ rows a warp"):
        dataclasses.replace(base, gate_up_warps=8)
    dataclasses.replace(base, gate_up_warps=8, group_size=32)  # other group sizes are fine


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_router_finish_tokens_is_a_power_of_two() -> None:
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    base = _moe_small.decode_tiles_for(64)
    assert base.router_finish_tokens == 4
    for bad in (0, 3, 12):
        with pytest.raises(ValueError, match="router_finish_tokens"):
            dataclasses.replace(base, router_finish_tokens=bad)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "order"), [(17, 0), (64, 0), (300, 1), (2000, 2)])
def test_gpu_split_router(gpu_weights: MoeWeights, num_tokens: int, order: int) -> None:
    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    check_split_router(x, gpu_weights, 192, order)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_pairs", "group_size"), [(68, 8), (1024, 8), (1536, 16), (4000, 32)])
def test_gpu_groups(num_pairs: int, group_size: int) -> None:
    check_groups("cuda", num_pairs, 128, group_size, seed=fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize(("num_pairs", "group_size"), [(8200, 64), (32768, 128)])
def test_gpu_table_groups(num_pairs: int, group_size: int) -> None:
    check_table_groups("cuda", num_pairs, group_size, seed=fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64, 65, 256, 384, 1000])
def test_gpu_decode_routing(gpu_weights: MoeWeights, num_tokens: int) -> None:
    check_decode_routing(random_x(num_tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
def test_gpu_decode_tile_variants(gpu_weights: MoeWeights, variant: int) -> None:
    """Every covered launch shape, with the routing computed in-kernel (3 tokens)."""
    x = random_x(3, 2880, device="cuda", seed=fresh_seed())
    check_decode_routing(x, gpu_weights, _decode_variants()[variant])


# -- the decode kernels compile for Hopper (Triton's own ptxas; no GPU needed) -----------------


# The per-pair kernels' constexprs at 120b shapes, as the launches give them.
def _down_constexprs(tiles) -> dict:
    from gptoss_serve.kernels._moe_small import split_plan  # noqa: PLC0415

    down = dict(N=2880, K=2880, TOP_K=4, BR=tiles.down_rows, SPLIT=tiles.down_split,
                NUM_STAGES=tiles.down_stages, PTX=tiles.ptx, PDL=tiles.pdl, INTERPRET=False,
                EARLY=tiles.down_early_dependents)  # fmt: skip
    return down | split_plan(2880, tiles.down_split, tiles.down_unroll)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
def test_decode_kernels_compile_for_sm90(variant: int) -> None:
    """The decode path's kernels at 120b shapes: weights and activations streamed by cp.async
    into mma.sync, the decode's packed bf16 multiplies, no local memory; griddepcontrol (wait and
    launch_dependents) with PDL."""
    from gptoss_serve.kernels import _moe_decode  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import split_plan  # noqa: PLC0415

    tiles = _decode_variants()[variant]
    common = dict(TOP_K=4, PTX=tiles.ptx, PDL=tiles.pdl, INTERPRET=False)
    gate_up = dict(H=2880, N=5760, E=128, ROUTED=False, BN=tiles.gate_up_rows * tiles.gate_up_split)
    gate_up |= dict(SPLIT=tiles.gate_up_split, NUM_STAGES=tiles.gate_up_stages,
                    WARP_TOPK=tiles.topk_copies)  # fmt: skip
    gate_up |= split_plan(2880, tiles.gate_up_split, tiles.gate_up_unroll) | common
    for kernel, constexprs, warps, stages in [
        (_moe_decode._gate_up_kernel, gate_up, tiles.gate_up_warps, tiles.gate_up_stages),
        (_moe_decode._down_kernel, _down_constexprs(tiles), tiles.down_warps, tiles.down_stages),
    ]:
        options = dict(num_warps=warps, num_stages=stages)
        ptx = compile_sm90(kernel, constexprs, SM90_POINTERS, options)
        assert "cp.async" in ptx and "mma.sync" in ptx
        assert ".local" not in ptx
        assert ("mul.rn.bf16x2" in ptx) == tiles.ptx
        assert ("griddepcontrol.wait" in ptx) == tiles.pdl
        assert ("griddepcontrol.launch_dependents" in ptx) == tiles.pdl
    for num_tokens in (1, 4, 16):  # all of H in one step (4096 columns), 1024 columns a step
        router = router_constexprs(tiles, num_tokens)
        assert (router["BLOCK_K"] >= 2880) == (num_tokens <= 4)
        ptx = compile_sm90(_moe_decode._router_kernel, router, SM90_POINTERS, dict(num_warps=4))
        assert ".local" not in ptx
        if tiles.pdl and tiles.router_preload and num_tokens <= 4:  # weights before the wait
            assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
def test_small_batch_down_and_router_let_the_next_kernel_in_at_their_start() -> None:
    """With PDL the 1-token row's router and down (and the 2-token row's down) call
    launch_dependents before their wait, so the norm and q/k/v after down load their gains and
    weights beside its stream; from 3 tokens down and at 2 the router do so after their GEMV
    (bench/RESULTS.md v28)."""
    from gptoss_serve.kernels import _moe_decode  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415
    from gptoss_serve.kernels.mxfp4_layout import STEP_ROWS  # noqa: PLC0415

    def trigger_first(ptx: str) -> bool:
        return ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")

    for num_tokens, down_early, router_early in [(1, True, True), (2, True, False),
                                                 (4, False, False)]:  # fmt: skip
        tiles = dataclasses.replace(decode_tiles_for(num_tokens), pdl=True)
        assert (tiles.down_early_dependents, tiles.router_early_dependents) == (
            down_early, router_early)  # fmt: skip
        down = _down_constexprs(tiles) | dict(LB=STEP_ROWS)
        options = dict(num_warps=tiles.down_warps, num_stages=tiles.down_stages)
        ptx = compile_sm90(_moe_decode._down_kernel, down, SM90_POINTERS, options)
        assert trigger_first(ptx) == down_early
        router = router_constexprs(tiles, num_tokens)
        ptx = compile_sm90(_moe_decode._router_kernel, router, SM90_POINTERS, dict(num_warps=4))
        assert trigger_first(ptx) == router_early
        assert ".local" not in ptx


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
def test_small_batch_gate_up_keeps_its_registers() -> None:
    """The 1-token row's gate_up with its top-4 in every warp: 80 registers a thread at 120b
    shapes with K in 2 parts, 108-110 in 4 (since v27: twice the words a thread a step),
    against 168 when the top-4's reductions crossed warps (bench/RESULTS.md v16): 4-warp
    programs fit 4 an SM, where the 360 programs need 2.7. The 3-4-token row (its routing from
    the router since v29) stays under the same bound. (5-8 tokens take the grouped columns on
    the H200 since e30, which this test's 8 tokens then met.)"""
    from gptoss_serve.kernels import _moe_decode  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import decode_tiles_for, split_plan  # noqa: PLC0415
    from gptoss_serve.kernels.mxfp4_layout import STEP_ROWS  # noqa: PLC0415

    pointers = {"x_thread_ptr": "*bf16", "h_ptr": "*bf16", "bias_ptr": "*bf16"}
    pointers |= {"logits_ptr": "*fp32", "routing_weights_ptr": "*fp32"}
    pointers |= {"blocks_ptr": "*u8", "scales_ptr": "*u8"}
    for num_tokens, routed in ((1, False), (3, True)):
        tiles = decode_tiles_for(num_tokens)
        assert tiles.warp_topk != routed and tiles.route_in_router == routed
        assert not tiles.group_columns
        constexprs = dict(H=2880, N=5760, E=128, TOP_K=4, ROUTED=routed, PTX=True, PDL=True,
                          INTERPRET=False, LB=STEP_ROWS, WARP_TOPK=tiles.topk_copies,
                          BN=tiles.gate_up_rows * tiles.gate_up_split, SPLIT=tiles.gate_up_split,
                          NUM_STAGES=tiles.gate_up_stages)  # fmt: skip
        constexprs |= split_plan(2880, tiles.gate_up_split, tiles.gate_up_unroll)
        options = dict(num_warps=tiles.gate_up_warps, num_stages=tiles.gate_up_stages)
        assert sm90_registers(_moe_decode._gate_up_kernel, constexprs, pointers, options) <= 112


def columns_ptx(tiles) -> list[str]:
    """PTX of the grouped columns' gate_up and down as the engine launches them at 120b shapes:
    the blocks in bands of 16 rows padded to whole steps (no masks in tile order)."""
    from gptoss_serve.kernels import _moe_columns  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import _full_steps  # noqa: PLC0415
    from gptoss_serve.kernels.mxfp4_layout import STEP_ROWS  # noqa: PLC0415

    steps = _full_steps(2880, whole=tiles.tile_order) | {"LB": STEP_ROWS}
    pointers = {"x_thread_ptr": "*bf16", "h_ptr": "*bf16", "bias_ptr": "*bf16"}
    pointers |= {"blocks_ptr": "*u8", "scales_ptr": "*u8", "routing_weights_ptr": "*fp32"}
    pointers |= {"y_ptr": "*fp32"}
    common = dict(TOP_K=4, COLS=tiles.group_size, PTX=True, PDL=False, INTERPRET=False)
    stride = 2944 if tiles.tile_order else 2880  # tile order: rows of 23 steps of 128
    common |= dict(TILE_ORDER=tiles.order, H_STRIDE=stride, SCALE_WORDS=tiles.scale_words)
    common |= dict(EXTRA=tiles.next_group_columns)
    common |= steps
    return [
        compile_sm90(kernel, constexprs, pointers, dict(num_warps=warps, num_stages=stages))
        for kernel, constexprs, warps, stages in [
            (_moe_columns._columns_gate_up_kernel,
             dict(H=2880, N=5760, BN=tiles.gate_up_rows, NUM_STAGES=tiles.gate_up_stages)
             | common | {"X_STRIDE": stride},
             tiles.gate_up_warps, tiles.gate_up_stages),
            (_moe_columns._columns_down_kernel,
             dict(N=2880, K=2880, BN=tiles.down_rows, NUM_STAGES=tiles.down_stages) | common,
             tiles.down_warps, tiles.down_stages),
        ]
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_grouped_columns_kernels_compile_for_sm90() -> None:
    """The expert-grouped path at 120b shapes and its table's mma.sync tiles (8 and 16
    columns) in the wgmma tile order (kWidth 2): cp.async into mma.sync, no lane shuffle, no
    local memory; the grouping kernel for 64 and 128 tokens. Groups of 16 columns (two n8
    MMAs) compile at the 64-token tiles too; so does the K-split router."""
    from gptoss_serve.kernels import _moe_columns  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415

    for num_tokens, group_size in [(64, None), (128, None), (64, 16)]:
        tiles = decode_tiles_for(num_tokens)
        assert tiles.group_columns and tiles.wgmma_order
        if group_size:
            tiles = dataclasses.replace(tiles, group_size=group_size)
        for ptx in columns_ptx(tiles):
            assert "cp.async" in ptx and "mma.sync" in ptx and "mul.rn.bf16x2" in ptx
            assert ".local" not in ptx and "shfl" not in ptx
        num_pairs = 4 * num_tokens
        p_pad = 1 << (num_pairs - 1).bit_length()
        g_bound = _moe_columns.max_groups(p_pad, 128, tiles.group_size)
        group = dict(COLS=tiles.group_size, P_PAD=p_pad, E_PAD=128, PDL=False, TOP_K=4)
        group |= dict(FILL=min(4096, 1 << (g_bound * tiles.group_size - 1).bit_length()))
        ptx = compile_sm90(_moe_columns._group_kernel, group, {}, dict(num_warps=8))
        assert ".local" not in ptx
    from gptoss_serve.kernels import _moe_router_split  # noqa: PLC0415

    split = dict(H=2880, E=128, E_PAD=128, BLOCK_T=32, BLOCK_K=64, SPLIT_K=192, PDL=True)
    split |= dict(INTERPRET=False, TILE_ORDER=False, X_STRIDE=2880)
    tile = split | dict(BLOCK_K=128, SPLIT_K=256, TILE_ORDER=True, X_STRIDE=2944)
    finish = dict(NUM_PARTS=15, E=128, E_PAD=128, BLOCK_T=16, TOP_K=4, K_PAD=4, PDL=True)
    for kernel, constexprs in [(_moe_router_split._router_split_kernel, split),
                               (_moe_router_split._router_split_kernel, tile),
                               (_moe_router_split._router_finish_kernel, finish)]:  # fmt: skip
        ptx = compile_sm90(kernel, constexprs, {"x_ptr": "*bf16", "weight_ptr": "*bf16"},
                           dict(num_warps=4))  # fmt: skip
        assert ".local" not in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize(
    ("num_tokens", "extra"), [(256, 0), (512, 0), (2048, 0), (2048, 16), (8192, 0), (8192, 64)]
)
def test_wgmma_columns_compile_for_sm90(num_tokens: int, extra: int) -> None:
    """The table's wgmma rows: the decoded weights go into wgmma as its register operand with
    no lane shuffle (the wgmma tile order; in mma.sync's order this tile needs 32 shfl per
    thread and step), the activations by cp.async; no local memory; also with an expert's
    short last group as extra columns (``extra``: 16, or 64 on the 8-warp groups of 128)."""
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415

    tiles = dataclasses.replace(decode_tiles_for(num_tokens), next_group_columns=extra)
    assert tiles.wgmma_order
    for ptx in columns_ptx(tiles):
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx and "mul.rn.bf16x2" in ptx
        assert "shfl" not in ptx and ".local" not in ptx


def test_the_per_pair_rows_serve_up_to_the_cards_count(monkeypatch) -> None:
    """5-8 tokens take the grouped columns (the table) except on a card of
    PER_PAIR_MAX_TOKENS_BY_CARD (the H100: the per-pair GEMVs up to 8 tokens); no device, or
    one that is not CUDA, gets the table as it is."""
    pytest.importorskip("triton")
    from gptoss_serve.kernels import _moe_tiles  # noqa: PLC0415

    per_pair_row = next(t for n, t in _moe_tiles.DECODE_TILES if n == 4)
    cuda = torch.device("cuda", 0)
    try:
        for name, grouped_from in (("NVIDIA H100 80GB HBM3", 9), ("NVIDIA H200", 5)):
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None, n=name: n)
            _moe_tiles._card_name.cache_clear()
            for num_tokens in range(1, 20):
                tiles = _moe_tiles.decode_tiles_for(num_tokens, cuda)
                assert tiles.group_columns == (num_tokens >= grouped_from), (name, num_tokens)
                if 3 <= num_tokens < grouped_from:
                    assert tiles == per_pair_row
                if num_tokens <= 4 or num_tokens >= 9:  # the cards differ only at 5-8
                    assert tiles == _moe_tiles.decode_tiles_for(num_tokens)
    finally:
        _moe_tiles._card_name.cache_clear()
    for num_tokens in (5, 8):
        assert _moe_tiles.decode_tiles_for(num_tokens, torch.device("cpu")).group_columns
