"""Experiment (not wired into the engine): the decode-path MoE GEMVs with the pairs grouped by
expert, so each expert's rows are decoded once for up to 8 (token, slot) pairs.

The decode path (kernels/_moe_decode.py) runs one gate_up program per (pair, row tile): a
pair streams and decodes its expert's rows even when other pairs of the batch chose the same
expert (then from L2), and the n8 MMA carries one or two useful activation columns. At 64
tokens (256 pairs over ~111 experts) that is ~2.3x the decode work and L2 traffic the distinct
experts need. Here a program takes (row tile, group), a group being one expert and up to 8
of its pairs, whose activations fill the MMA's 8 columns; down writes each pair's weighted
rows and a sum over each token's k pairs follows.

The grouping is done on the host with torch (sorts, unique: host syncs), outside the timed
region; a production version would group on the device into a fixed-size grid (an upper
bound of min(pairs, E + pairs / 8) groups, the rest exiting), as the grouped path's routing
does. So the figures below are the GEMVs alone, against the decode path's GEMVs alone.

    cd bench && python3 moe_grouped_decode.py [--tokens 8,16,32,64]

Prints, per T: the decode path's gate_up and down (us), the grouped ones, the sum over pairs,
and the max relative difference of the MoE output against the decode path.
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import argparse
import logging
import sys

import torch
import triton
import triton.language as tl
from gpu_model import random_moe_weights
from moe_profile import CALLS, TOP_K, gate_up, make_case, timed

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels._moe_common import _to_bf16
from gptoss_serve.kernels._moe_gemv import ACC_SCALE, _mxfp4_gemv, _tile_slots
from gptoss_serve.kernels.moe import MoeWeights

logger = logging.getLogger("bench.moe_grouped_decode")
COLUMNS = 8  # pairs per group: the n8 MMA's columns


@triton.jit
def _group_columns(group_pairs_ptr, g, TOP_K: tl.constexpr):
    cols = tl.arange(0, 8)
    pairs = tl.load(group_pairs_ptr + g * 8 + cols)
    valid = pairs >= 0
    return pairs, valid, tl.where(valid, pairs // TOP_K, 0)


@triton.jit
def _grouped_gate_up_kernel(
    x_thread_ptr, group_expert_ptr, group_pairs_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr,
    alpha, limit,
    H: tl.constexpr, N: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = H // 32
    n0 = tl.program_id(0) * BN
    g = tl.program_id(1)
    expert = tl.load(group_expert_ptr + g).to(tl.int64)
    pairs, valid, tokens = _group_columns(group_pairs_ptr, g, TOP_K)
    rows, t = _tile_slots(BN)
    row = n0 + rows
    row_groups = tl.where(row < N, G, 0)
    row = tl.minimum(row, N - 1)
    block_rows = blocks_ptr + expert * (N * H // 2) + row * (H // 2) + 16 * t
    scale_rows = scales_ptr + expert * (N * G) + row * G + t
    col_ptrs = x_thread_ptr + tokens * H
    acc = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, col_ptrs, tl.where(valid, G, 0),
        BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
    )  # fmt: skip
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    y = acc * ACC_SCALE + bias.to(tl.float32)[:, None]  # [BN, 8]: column c is pair c
    gate, up = tl.split(tl.permute(tl.reshape(y, [BN // 2, 2, 8]), (0, 2, 1)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = _to_bf16(gate * tl.sigmoid(alpha * gate) * (up + 1.0), INTERPRET)  # [BN/2, 8]
    units = n0 // 2 + tl.arange(0, BN // 2)
    position = (units & ~7) | ((units & 1) << 2) | (units & 2) | ((units >> 2) & 1)
    ptrs = h_ptr + pairs.to(tl.int64)[None, :] * (N // 2) + position[:, None]
    tl.store(ptrs, h, mask=(units < N // 2)[:, None] & valid[None, :])


@triton.jit
def _grouped_down_kernel(
    h_ptr, group_expert_ptr, group_pairs_ptr, routing_weights_ptr, blocks_ptr, scales_ptr,
    bias_ptr, y_ptr,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr,
    STEPS: tl.constexpr, FULL_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr, PTX: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """y[pair, n0 : n0 + BN] fp32 = w_pair · (h_pair @ Wd[expert][rows]^T + bd)."""
    G: tl.constexpr = K // 32
    n0 = tl.program_id(0) * BN
    g = tl.program_id(1)
    expert = tl.load(group_expert_ptr + g).to(tl.int64)
    pairs, valid, _ = _group_columns(group_pairs_ptr, g, TOP_K)
    rows, t = _tile_slots(BN)
    row = n0 + rows
    row_groups = tl.where(row < N, G, 0)
    row = tl.minimum(row, N - 1)
    block_rows = blocks_ptr + expert * (N * K // 2) + row * (K // 2) + 16 * t
    scale_rows = scales_ptr + expert * (N * G) + row * G + t
    col_ptrs = h_ptr + tl.where(valid, pairs, 0).to(tl.int64) * K
    acc = _mxfp4_gemv(
        block_rows, scale_rows, row_groups, t, col_ptrs, tl.where(valid, G, 0),
        BN, STEPS, FULL_STEPS, 1, NUM_STAGES, PTX, INTERPRET,
    )  # fmt: skip
    out_rows = n0 + tl.arange(0, BN)
    bias = tl.load(bias_ptr + expert * N + out_rows, mask=out_rows < N, other=0.0)
    weights = tl.load(routing_weights_ptr + pairs, mask=valid, other=0.0)
    y = (acc * ACC_SCALE + bias.to(tl.float32)[:, None]) * weights[None, :]
    ptrs = y_ptr + pairs.to(tl.int64)[None, :] * N + out_rows[:, None]
    tl.store(ptrs, y, mask=(out_rows < N)[:, None] & valid[None, :])


def group_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (group_expert [G] int32, group_pairs [G, 8] int32, -1 padded): every
    expert's pairs in chunks of up to 8 (host syncs: the experiment's grouping)."""
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=ids.device) - starts[experts]
    keys, group = torch.unique(experts * 1024 + rank // COLUMNS, return_inverse=True)
    pairs = torch.full((keys.numel(), COLUMNS), -1, dtype=torch.int32, device=ids.device)
    pairs[group, rank % COLUMNS] = order.int()
    return (keys // 1024).int(), pairs


def _plan(k: int) -> dict[str, int]:
    plan = small.split_plan(k, 1)
    return {"STEPS": plan["STEPS"], "FULL_STEPS": plan["FULL_STEPS"]}


def grouped_gate_up(weights: MoeWeights, x_thread, groups, h, *, rows=32, warps=2, stages=4):
    group_expert, pairs = groups
    n = 2 * weights.intermediate_size
    _grouped_gate_up_kernel[(triton.cdiv(n, rows), group_expert.numel())](
        x_thread, group_expert, pairs, weights.gate_up_blocks, weights.gate_up_scales,
        weights.gate_up_bias, h, 1.702, 7.0, H=weights.hidden_size, N=n, TOP_K=TOP_K, BN=rows,
        **_plan(weights.hidden_size), NUM_STAGES=stages, PTX=not _interpreting(),
        INTERPRET=_interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip


def grouped_down(weights: MoeWeights, h, groups, gates, y, *, rows=32, warps=2, stages=4):
    group_expert, pairs = groups
    hidden = weights.hidden_size
    _grouped_down_kernel[(triton.cdiv(hidden, rows), group_expert.numel())](
        h, group_expert, pairs, gates, weights.down_blocks, weights.down_scales,
        weights.down_bias, y, N=hidden, K=weights.intermediate_size, TOP_K=TOP_K, BN=rows,
        **_plan(weights.intermediate_size), NUM_STAGES=stages, PTX=not _interpreting(),
        INTERPRET=_interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def measure(weights: MoeWeights, tokens: int) -> tuple[float, dict[str, float], float, bool]:
    """(mean groups per call, us per stage, max relative difference of the output against
    the decode path, whether h is bit-identical) at T = ``tokens``."""
    case = make_case(weights, tokens)
    tiles = small.decode_tiles_for(tokens)
    groups = [group_pairs(case.ids[i], weights.num_experts) for i in range(CALLS)]
    gates = [case.gates[i].flatten() for i in range(CALLS)]
    h = [torch.empty_like(case.h[i]) for i in range(CALLS)]
    ys = [torch.empty(tokens * TOP_K, weights.hidden_size, device="cuda") for _ in range(CALLS)]
    for i in range(CALLS):
        grouped_gate_up(weights, case.x_thread[i], groups[i], h[i])
        grouped_down(weights, h[i], groups[i], gates[i], ys[i])
    reference = [small.mxfp4_moe_decode(case.xs[i], weights, tiles=tiles).out for i in range(3)]
    outs = [ys[i].view(tokens, TOP_K, -1).sum(1) for i in range(len(reference))]
    rel = max(
        float((o - r.float()).abs().max() / r.float().abs().max())
        for o, r in zip(outs, reference, strict=True)
    )
    h_equal = all(torch.equal(h[i], case.h[i]) for i in range(CALLS))

    def decode_down(i: int) -> None:
        small.launch_down(
            weights, case.h[i], case.ids[i], case.gates[i], out=case.outs[i], tiles=tiles
        )

    figures = {
        "decode gate_up": timed(lambda i: gate_up(weights, case, i, tiles)),
        "decode down": timed(decode_down),
        "grouped gate_up": timed(
            lambda i: grouped_gate_up(weights, case.x_thread[i], groups[i], h[i])
        ),
        "grouped down": timed(lambda i: grouped_down(weights, h[i], groups[i], gates[i], ys[i])),
        "sum over pairs": timed(lambda i: ys[i].view(tokens, TOP_K, -1).sum(1)),
    }
    return sum(g[0].numel() for g in groups) / CALLS, figures, rel, h_equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8,16,32,64")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    weights = random_moe_weights(ModelConfig.from_dict(preset_config("120b")))
    rows = [(int(t), *measure(weights, int(t))) for t in args.tokens.split(",")]
    sys.stdout.write("\n    T  groups  " + "  ".join(f"{k:>16}" for k in rows[0][2]) + "\n")
    for tokens, num_groups, figures, rel, h_equal in rows:
        cells = "  ".join(f"{v:16.2f}" for v in figures.values())
        sys.stdout.write(
            f"{tokens:5d}  {num_groups:6.1f}  {cells}  max_rel {rel:.2e}  h identical: {h_equal}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
