"""The decode router's last program grouping the pairs by expert for the grouped columns
(``DecodeTiles.group_in_router``, 5-16 tokens): its groups equal the torch reference's (the
pairs of padding rows in none), and the MoE's output is bit for bit the one with the grouping
launch of its own; under the interpreter (small ragged shapes) and on the GPU (120b/20b
shapes); the router so built compiles for sm_90 without local memory."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from compare import poisoned
from moe_cases import (
    INTERPRETING,
    SM90_POINTERS,
    compile_sm90,
    fresh_seed,
    interpreter,
    random_weights,
    random_x,
    router_constexprs,
)

from gptoss_serve.kernels.moe import MoeWeights

# (tokens, valid rows): a padded step leaves the rows from valid_rows[0] on out of the groups.
CASES = [(5, None), (8, 6), (9, None), (16, 11)]


def check_router_groups(
    x: torch.Tensor, weights: MoeWeights, valid: int | None, *, pdl: bool = False
) -> None:
    from gptoss_serve.kernels import _moe_columns, _moe_small  # noqa: PLC0415

    num_tokens, hidden = x.shape
    device = x.device
    valid_rows = None if valid is None else torch.tensor([valid], dtype=torch.int32, device=device)
    table = dataclasses.replace(_moe_small.decode_tiles_for(num_tokens, device), pdl=pdl)
    assert table.group_columns and table.group_in_router  # the table's 5-16-token rows
    assert _moe_small.groups_in_router(table, num_tokens)
    apart = dataclasses.replace(table, group_in_router=False)
    outputs = []
    for tiles in (table, apart):
        out = poisoned(tuple(x.shape), torch.bfloat16, str(device))
        _moe_small.mxfp4_moe_decode(x, weights, tiles=tiles, out=out, poison=True,
                                    valid_rows=valid_rows)  # fmt: skip
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    # The router alone, into poisoned tables: every entry written, as the reference has it.
    ids = torch.full((num_tokens, 4), -7, dtype=torch.int32, device=device)
    gates = poisoned((num_tokens, 4), torch.float32, str(device))
    logits = poisoned((num_tokens, weights.num_experts), torch.float32, str(device))
    x_thread = torch.empty(num_tokens, _moe_small.row_width(hidden, table.tile_order),
                           dtype=torch.bfloat16, device=device)  # fmt: skip
    groups = _moe_small.group_buffers(num_tokens * 4, weights.num_experts, table, device)
    for buffer in groups:
        buffer.fill_(99)
    _moe_small.launch_router(x, weights, logits, x_thread, table, ids=ids, gates=gates,
                             groups=groups, valid_rows=valid_rows)  # fmt: skip
    num_valid = num_tokens if valid is None else valid
    expected = _moe_columns.groups_reference(ids[:num_valid], weights.num_experts,
                                             table.group_size, groups[0].shape[0])  # fmt: skip
    assert torch.equal(groups[0].cpu(), expected[0])
    assert torch.equal(groups[1].cpu(), expected[1])
    with pytest.raises(ValueError, match="groups_in_router"):  # groups, but no routing
        _moe_small.launch_router(x, weights, logits, x_thread, table, groups=groups)


@interpreter
@pytest.mark.parametrize(("num_tokens", "valid"), CASES)
def test_interpreter_router_groups(num_tokens: int, valid: int | None) -> None:
    """H = 160, 8 experts: several pairs an expert, so groups of 8 fill and overflow."""
    weights = random_weights(8, 160, 96, seed=80 + num_tokens)
    check_router_groups(random_x(num_tokens, 160, seed=81), weights, valid)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "valid"), CASES)
def test_gpu_router_groups(gpu_weights: MoeWeights, num_tokens: int, valid: int | None) -> None:
    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    check_router_groups(x, gpu_weights, valid, pdl=True)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.parametrize("num_tokens", [8, 16])
def test_grouping_router_compiles_for_sm90(num_tokens: int) -> None:
    """The 5-16-token rows' router with the grouping in its last program (120b shapes)."""
    from gptoss_serve.kernels import _moe_decode, _moe_small  # noqa: PLC0415

    tiles = dataclasses.replace(_moe_small.decode_tiles_for(num_tokens), pdl=True)
    assert tiles.route_in_router
    constexprs = router_constexprs(tiles, num_tokens) | dict(GROUP_COLS=tiles.group_size,
                                                             GROUP_FILL=256)  # fmt: skip
    ptx = compile_sm90(_moe_decode._router_kernel, constexprs, SM90_POINTERS, dict(num_warps=4))
    assert ".local" not in ptx
    assert "atom.global" in ptx  # the ticket that picks the last program
