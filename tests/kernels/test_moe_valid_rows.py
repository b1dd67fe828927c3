"""Padding rows of the MXFP4 MoE (``valid_rows``, int32 [1] on the device): the rows of a
CUDA-graph batch past the step's real ones are left out of the expert grouping (no expert
weights read for them) and come out as zeros, while the real rows come out bit for bit as from
a call on them alone (each pair is its own MMA column or GEMM row: grouping changes no value).
The grouped columns (_moe_columns.py, from 9 tokens; their groups from the one-program sort or,
past SORT_MAX_PAIRS, from the block table), the grouped GEMMs (_moe_triton.py: one-program and
atomic routing), the whole op with its own router, and the plain-torch reference; under the
interpreter (small ragged shapes) and on the GPU (120b/20b shapes, a captured graph whose count
changes between replays). The per-pair GEMVs (1-8 tokens) do not read the count (kernels/moe.py
says why); the engine never pads a step that small.
"""

from __future__ import annotations

import pytest
import torch
from compare import poisoned
from moe_cases import fresh_seed, interpreter, random_weights, random_x, reference_routing

from gptoss_serve.kernels.moe import MoeWeights, mxfp4_moe, mxfp4_moe_reference


def padded_x(num_tokens: int, num_valid: int, hidden: int, *, device: str = "cpu",
             seed: int = 1) -> torch.Tensor:  # fmt: skip
    """``num_valid`` random rows, then identical padding rows, as the engine's (token 0 at
    position 0 in every one): they all choose the same experts."""
    x = random_x(num_valid + 1, hidden, device=device, seed=seed)
    padding = x[num_valid:].expand(num_tokens - num_valid, hidden)
    return torch.cat([x[:num_valid], padding]).contiguous()


def count(num_valid: int, device) -> torch.Tensor:
    return torch.tensor([num_valid], dtype=torch.int32, device=device)


def assert_padding_left_out(padded: torch.Tensor, alone: torch.Tensor, num_valid: int) -> None:
    """The real rows bit for bit as computed alone, the padding rows exactly zero."""
    assert torch.equal(padded[:num_valid].view(torch.int16), alone.view(torch.int16))
    assert torch.equal(padded[num_valid:], torch.zeros_like(padded[num_valid:]))


def check_given_routing(x: torch.Tensor, weights: MoeWeights, num_valid: int, **path) -> None:
    """moe_experts_triton with the fp32 routing of every row given (``path``: its
    ``decode_tiles`` or ``tiles``), into poisoned outputs and scratch."""
    from gptoss_serve.kernels._moe_triton import moe_experts_triton  # noqa: PLC0415

    expert_ids, routing_weights = reference_routing(x, weights)

    def run(rows: int, valid_rows: torch.Tensor | None) -> torch.Tensor:
        out = poisoned((rows, x.shape[1]), torch.bfloat16, str(x.device))
        return moe_experts_triton(
            x[:rows], weights, expert_ids[:rows], routing_weights[:rows], out=out, poison=True,
            valid_rows=valid_rows, **path,
        )  # fmt: skip

    num_tokens = x.shape[0]
    alone = run(num_valid, None)
    assert_padding_left_out(run(num_tokens, count(num_valid, x.device)), alone, num_valid)
    # A count of every row (an unpadded step) changes nothing.
    assert torch.equal(run(num_valid, count(num_valid, x.device)), alone)


def check_full_op(x: torch.Tensor, weights: MoeWeights, num_valid: int) -> None:
    """The whole Triton op, its own router included (which routes the padding rows too)."""
    from gptoss_serve.kernels._moe_triton import mxfp4_moe_triton  # noqa: PLC0415

    padded = mxfp4_moe_triton(x, weights, poison=True, valid_rows=count(num_valid, x.device))
    alone = mxfp4_moe_triton(x[:num_valid], weights, poison=True)
    assert_padding_left_out(padded, alone, num_valid)


def check_groups_leave_out_padding(
    device: str, num_tokens: int, num_valid: int, group_size: int, seed: int
) -> None:
    """``group`` with a count: no group holds a pair of a padding token, and the groups are
    those of the real tokens' routing alone (past SORT_MAX_PAIRS in the table's order within
    an expert, which changes no value)."""
    from gptoss_serve.kernels import _moe_columns, _moe_small  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(num_valid + 1)])
    ids = torch.cat([ids, ids[-1:].expand(num_tokens - num_valid - 1, 4)]).to(torch.int32)
    ids = ids.contiguous().to(device)
    tiles = _moe_small.DecodeTiles(
        group_columns=True, group_size=group_size, gate_up_split=1, down_rows=16, down_split=1
    )
    group_expert, group_pairs = _moe_small.group(ids, 8, tiles, count(num_valid, device))
    group_expert, group_pairs = group_expert.cpu(), group_pairs.cpu()
    assert int(group_pairs.max()) < num_valid * 4  # no pair of a padding token
    g_max = _moe_columns.max_groups(ids.numel(), 8, group_size)
    expected = _moe_columns.groups_reference(ids[:num_valid], 8, group_size, g_max)
    assert torch.equal(group_expert, expected[0])
    for expert in range(8):
        mine, theirs = group_pairs[expected[0] == expert], expected[1][expected[0] == expert]
        assert torch.equal(mine[mine >= 0].sort().values, theirs[theirs >= 0].sort().values)


def _columns_tiles(order: int, group_size: int = 8):
    from gptoss_serve.kernels import _moe_small  # noqa: PLC0415

    return _moe_small.DecodeTiles(
        group_columns=True, group_size=group_size, gate_up_rows=32, gate_up_split=1,
        down_rows=16, down_split=1, tile_order=order > 0, wgmma_order=order == 2,
        scale_words=order == 2,
    )  # fmt: skip


# -- the reference (CPU) -------------------------------------------------------------------------


def test_reference_zeroes_the_padding_rows() -> None:
    weights = random_weights(8, 64, 96, seed=5)
    x = padded_x(7, 3, 64, seed=6)
    expected = mxfp4_moe_reference(x[:3], weights)
    for op in (mxfp4_moe_reference, mxfp4_moe):  # mxfp4_moe: the reference on the CPU
        padded = op(x, weights, valid_rows=count(3, "cpu"))
        assert torch.equal(padded[:3], expected)
        assert torch.equal(padded[3:], torch.zeros_like(padded[3:]))
    assert torch.equal(mxfp4_moe_reference(x, weights, valid_rows=count(7, "cpu")),
                       mxfp4_moe_reference(x, weights))  # fmt: skip
    nothing = mxfp4_moe_reference(x, weights, valid_rows=count(0, "cpu"))
    assert torch.equal(nothing, torch.zeros_like(x))


# -- under the interpreter -------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize(("num_tokens", "num_valid", "group_size"),
                         [(16, 9, 8), (12, 9, 8), (40, 9, 16)])  # fmt: skip
def test_interpreter_groups_leave_out_padding(
    num_tokens: int, num_valid: int, group_size: int
) -> None:
    check_groups_leave_out_padding("cpu", num_tokens, num_valid, group_size, seed=num_tokens)


@interpreter
def test_interpreter_table_groups_leave_out_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    from gptoss_serve.kernels import _moe_columns  # noqa: PLC0415

    monkeypatch.setattr(_moe_columns, "SORT_MAX_PAIRS", 16)
    check_groups_leave_out_padding("cpu", 16, 9, 8, seed=4)


@interpreter
@pytest.mark.parametrize(("num_tokens", "order"), [(16, 0), (16, 2), (12, 1)])
def test_interpreter_grouped_columns_leave_out_padding(num_tokens: int, order: int) -> None:
    """9 real tokens over 8 experts and identical padding rows, whose pairs would otherwise
    push their 4 experts into a second group of 8 columns; thread or tile order."""
    weights = random_weights(8, 160, 96, seed=70)
    x = padded_x(num_tokens, 9, 160, seed=71)
    check_given_routing(x, weights, 9, decode_tiles=_columns_tiles(order))


@interpreter
def test_interpreter_table_columns_leave_out_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the groups from the block table (count, table, scatter)."""
    from gptoss_serve.kernels import _moe_columns  # noqa: PLC0415

    monkeypatch.setattr(_moe_columns, "SORT_MAX_PAIRS", 16)
    weights = random_weights(8, 160, 96, seed=72)
    check_given_routing(padded_x(16, 9, 160, seed=73), weights, 9,
                        decode_tiles=_columns_tiles(2))  # fmt: skip


@interpreter
@pytest.mark.parametrize("regime", [0, 1], ids=["one-program", "atomic"])
def test_interpreter_grouped_gemms_leave_out_padding(regime: int) -> None:
    """The grouped GEMMs' routing regimes (_moe_triton.py's small-batch and prefill tiles)."""
    from gptoss_serve.kernels._moe_triton import PREFILL_TILES, SMALL_BATCH_TILES  # noqa: PLC0415

    tiles = [SMALL_BATCH_TILES[0][1], PREFILL_TILES[0][1]][regime]
    weights = random_weights(8, 96, 64, seed=74)
    check_given_routing(padded_x(13, 9, 96, seed=75), weights, 9, tiles=tiles)


@interpreter
def test_interpreter_full_op_leaves_out_padding() -> None:
    """mxfp4_moe_triton at 12 tokens: the decode router, the table's grouped-columns tiles."""
    check_full_op(padded_x(12, 9, 160, seed=77), random_weights(8, 160, 96, seed=76), 9)


# -- on the GPU, 120b/20b shapes -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "num_valid"), [(16, 9), (24, 17), (64, 41), (160, 129)])
def test_gpu_grouped_columns_leave_out_padding(
    gpu_weights: MoeWeights, num_tokens: int, num_valid: int
) -> None:
    """The table's tiles for the padded size (mma.sync up to 128 tokens, wgmma past it)."""
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415

    x = padded_x(num_tokens, num_valid, 2880, device="cuda", seed=fresh_seed())
    check_given_routing(x, gpu_weights, num_valid, decode_tiles=decode_tiles_for(num_tokens))


@pytest.mark.gpu
def test_gpu_table_columns_leave_out_padding(gpu_weights: MoeWeights) -> None:
    """Past SORT_MAX_PAIRS (1100 tokens: 4400 pairs), the groups from the block table."""
    from gptoss_serve.kernels._moe_small import decode_tiles_for  # noqa: PLC0415

    x = padded_x(1100, 1030, 2880, device="cuda", seed=fresh_seed())
    check_given_routing(x, gpu_weights, 1030, decode_tiles=decode_tiles_for(1100))


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "num_valid"), [(16, 9), (64, 50)])
def test_gpu_full_op_leaves_out_padding(
    gpu_weights: MoeWeights, num_tokens: int, num_valid: int
) -> None:
    x = padded_x(num_tokens, num_valid, 2880, device="cuda", seed=fresh_seed())
    check_full_op(x, gpu_weights, num_valid)


@pytest.mark.gpu
def test_gpu_graph_reads_the_count_at_each_replay(gpu_weights: MoeWeights) -> None:
    """One graph of 16 rows captured with PDL, replayed with counts 9, 16 and 12 written into
    its buffer: each replay zeroes that replay's padding rows and leaves the others as they
    are alone (the count is read on the device, never captured as a value)."""
    x = random_x(16, 2880, device="cuda", seed=fresh_seed())
    valid_rows = count(16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mxfp4_moe(x, gpu_weights, pdl=True, valid_rows=valid_rows)  # compiles outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mxfp4_moe(x, gpu_weights, pdl=True, valid_rows=valid_rows)
    for num_valid in (9, 16, 12):
        valid_rows.fill_(num_valid)
        graph.replay()
        alone = mxfp4_moe(x[:num_valid].clone(), gpu_weights, pdl=True)
        assert_padding_left_out(captured.clone(), alone, num_valid)


@pytest.mark.gpu
def test_gpu_grouped_gemms_leave_out_padding(gpu_weights: MoeWeights) -> None:
    """The grouped GEMMs past DECODE_MAX_TOKENS are never padded by the engine; they honor
    the count all the same (atomic routing)."""
    from gptoss_serve.kernels._moe_triton import tiles_for  # noqa: PLC0415

    x = padded_x(300, 250, 2880, device="cuda", seed=fresh_seed())
    check_given_routing(x, gpu_weights, 250, tiles=tiles_for(300, gpu_weights.num_experts))
