"""The whole 120b decode step (PDL, CUDA graph: as bench/kernels.py times it) under other decode
MoE tiles (or decode-attention tiles) for one batch size, each variant timed between two runs
of the table's tiles.

    python bench/step_tiles.py --batch 1 --variants 'gate_up_warps=8,gate_up_stages=4' ...
                               [--context 1024] [--out bench/results/step_tiles.json]
    python bench/step_tiles.py --target attention --variants block_n=128,num_stages=4 ...
    python bench/step_tiles.py --target dense --batch 8 --variants gemv_max_tokens=4 ...
    python bench/step_tiles.py --target norm --variants wide_row_warps=4 ...
    python bench/step_tiles.py --variants norm:wide_row_warps=4 attention:merge_warps=2 ...

A variant is comma-separated ``field=value`` pairs of ``_moe_tiles.DecodeTiles`` replacing the
fields of the table row that serves ``--batch`` tokens on this card (``decode_tiles_for``; ints,
``None``, ``True``/``False``), and ``router_max_tokens`` replaces ``_moe_tiles.ROUTER_MAX_TOKENS``
(the most tokens the one-launch decode router takes, past which the K-split router does);
with ``--target attention``, of the ``_attention_decode.GPU_TILES`` row serving the batch;
with ``--target dense``, ``gemv_max_tokens`` replaces ``linear.GEMV_MAX_TOKENS`` (the largest
batch whose projections take the Triton GEMV), ``mma_max_tokens`` ``linear.MMA_MAX_TOKENS``
(the largest that takes the Triton tensor-core kernels rather than cuBLAS), ``mma_<field>`` a
field of ``linear.MMA_TILES`` (the plain projections' tensor-core tiles) and ``qkv_<field>``
one of ``rope.QKV_MMA_TILES`` (the fused q/k/v + RoPE kernel's; ``qkv_fused=False``: unfused;
``qkv_max_tokens``: ``rope.QKV_MMA_MAX_TOKENS``, the largest batch it serves), ``gemv_<field>``,
``gemv_wide_<field>``, ``gemv_pair_<field>`` and ``gemv_tall_<field>`` one of the GEMV's
``linear.GEMV_TILES`` (q/k/v), ``GEMV_TILES_WIDE`` (o), ``GEMV_TILES_WIDE_PAIR`` (o at 2 tokens)
and ``GEMV_TILES_TALL`` (the unembedding): ``rows``, ``num_warps``;
with ``--target norm``, ``wide_row_warps`` replaces ``_norm.WIDE_ROW_WARPS`` (the fused add +
RMSNorm's warps a row; the attention row's ``merge_warps`` is the split merge's). A variant
``TARGET:fields`` names its own target, so one run (one build of the weights) can vary several.
Isolated kernel timings (moe_profile.py) have disagreed with the whole step before (RESULTS
v8: routing in the router's last program), so the step decides. Random 120b-shaped weights,
built once; the same inputs for every variant, whose logits must equal the table's to the
bit where the variant changes only launch shapes that keep the reduction order (stages, warps
of the same tile), and are reported either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import DecodeStep

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _attention_decode as attention
from gptoss_serve.kernels import _moe_tiles as moe_tiles
from gptoss_serve.kernels import _norm as norm
from gptoss_serve.kernels import linear, rope
from kernels import graph_time_ms, write_results

LITERALS = {"None": None, "True": True, "False": False}
TARGETS = ("moe", "attention", "dense", "norm")


def split_target(text: str, default: str | None) -> tuple[str, str]:
    """(target, fields) of a variant: ``TARGET:fields``, or ``fields`` of ``default`` (None:
    the target must be named)."""
    target, colon, fields = text.partition(":")
    if not colon and default is not None:
        return default, text
    if target not in TARGETS or not fields:
        raise ValueError(f"a variant is [TARGET:]field=value,... with TARGET one of {TARGETS}, "
                         f"got {text!r}")  # fmt: skip
    return target, fields


def parse_variant(text: str) -> dict:
    fields = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        fields[name.strip()] = LITERALS[value] if value in LITERALS else int(value)
    return fields


def with_row(table: tuple, batch: int, fields: dict) -> tuple:
    """A (bound, tiles) table with the row serving ``batch`` replaced by ``fields``."""
    index = next(i for i, (n, _) in enumerate(table) if batch <= n)
    bound, tiles = table[index]
    rows = list(table)
    rows[index] = (bound, dataclasses.replace(tiles, **fields))
    return tuple(rows)


def apply(target: str, batch: int, fields: dict) -> None:
    """Install the variant (``restore`` puts the defaults back)."""
    if target == "attention":
        attention.GPU_TILES = with_row(DEFAULTS["attention"], batch, fields)
    elif target == "norm":
        norm.WIDE_ROW_WARPS = fields.pop("wide_row_warps", DEFAULTS["norm"])
        if fields:
            raise ValueError(f"norm variants take wide_row_warps, got {fields}")
    elif target == "dense":
        linear.GEMV_MAX_TOKENS = fields.pop("gemv_max_tokens", DEFAULTS["dense"])
        for prefix, attr in GEMV_ROWS:
            setattr(linear, attr, dataclasses.replace(DEFAULTS[attr], **prefixed(fields, prefix)))
        linear.MMA_MAX_TOKENS = fields.pop("mma_max_tokens", DEFAULTS["mma"])
        linear.MMA_TILES = dataclasses.replace(DEFAULTS["mma_tiles"], **prefixed(fields, "mma_"))
        qkv = prefixed(fields, "qkv_")
        fused = qkv.pop("fused", True)  # qkv_fused=False: the projection and RoPE apart
        rope.QKV_MMA_MAX_TOKENS = qkv.pop("max_tokens", DEFAULTS["qkv_max"])
        rope.QKV_MMA_TILES = dataclasses.replace(DEFAULTS["qkv_tiles"], **qkv) if fused else None
        if fields:
            raise ValueError(f"dense variants take gemv_max_tokens, mma_max_tokens, mma_<field>, "
                             f"qkv_<field> (MmaTiles' fields), gemv_<field>, gemv_wide_<field>, "
                             f"gemv_pair_<field>, gemv_tall_<field> (GemvTiles'); "
                             f"got {fields}")  # fmt: skip
    else:
        moe_tiles.ROUTER_MAX_TOKENS = fields.pop("router_max_tokens", DEFAULTS["router_max"])
        # the row this card serves ``batch`` tokens with (_moe_tiles.PER_PAIR_MAX_TOKENS_BY_CARD),
        # varied, as a row of its own for ``batch`` ahead of the table's, the card's rule off
        row = dataclasses.replace(moe_tiles.decode_tiles_for(batch, torch.device("cuda")), **fields)
        index = next(i for i, (n, _) in enumerate(DEFAULTS["moe"]) if batch <= n)
        table = list(DEFAULTS["moe"])
        table.insert(index, (batch, row))
        moe_tiles.PER_PAIR_MAX_TOKENS_BY_CARD = ()
        moe_tiles.DECODE_TILES = tuple(table)


def prefixed(fields: dict, prefix: str) -> dict:
    """The fields named ``prefix`` + an MmaTiles field, taken out of ``fields``, unprefixed."""
    names = [name for name in fields if name.startswith(prefix)]
    return {name.removeprefix(prefix): fields.pop(name) for name in names}


def restore() -> None:
    attention.GPU_TILES, moe_tiles.DECODE_TILES = DEFAULTS["attention"], DEFAULTS["moe"]
    moe_tiles.PER_PAIR_MAX_TOKENS_BY_CARD = DEFAULTS["per_pair"]
    moe_tiles.ROUTER_MAX_TOKENS = DEFAULTS["router_max"]
    linear.GEMV_MAX_TOKENS, linear.MMA_MAX_TOKENS = DEFAULTS["dense"], DEFAULTS["mma"]
    linear.MMA_TILES, rope.QKV_MMA_TILES = DEFAULTS["mma_tiles"], DEFAULTS["qkv_tiles"]
    rope.QKV_MMA_MAX_TOKENS = DEFAULTS["qkv_max"]
    norm.WIDE_ROW_WARPS = DEFAULTS["norm"]
    for _, attr in GEMV_ROWS:
        setattr(linear, attr, DEFAULTS[attr])


# The dense variants' GEMV fields: (prefix, linear's tiles it varies), the longer prefixes
# first, since "gemv_" begins the other two.
GEMV_ROWS = (("gemv_wide_", "GEMV_TILES_WIDE"), ("gemv_pair_", "GEMV_TILES_WIDE_PAIR"),
             ("gemv_tall_", "GEMV_TILES_TALL"), ("gemv_", "GEMV_TILES"))  # fmt: skip
DEFAULTS = {"attention": attention.GPU_TILES, "moe": moe_tiles.DECODE_TILES,
            "dense": linear.GEMV_MAX_TOKENS, "mma": linear.MMA_MAX_TOKENS,
            "mma_tiles": linear.MMA_TILES, "qkv_tiles": rope.QKV_MMA_TILES,
            "qkv_max": rope.QKV_MMA_MAX_TOKENS,
            "per_pair": moe_tiles.PER_PAIR_MAX_TOKENS_BY_CARD, "norm": norm.WIDE_ROW_WARPS,
            "router_max": moe_tiles.ROUTER_MAX_TOKENS,
            **{attr: getattr(linear, attr) for _, attr in GEMV_ROWS}}  # fmt: skip


def time_step(step: DecodeStep) -> tuple[float, torch.Tensor]:
    times = graph_time_ms(step, repeats=30)
    return statistics.median(times), step.last_logits.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--target", choices=TARGETS, default="moe")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results/step_tiles.json"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = ModelConfig.from_dict(preset_config("120b"))
    step = DecodeStep(config, batch=args.batch, context=args.context, pdl=True)
    rows = []
    base_ms, base_logits = time_step(step)
    for text in args.variants:
        target, fields = split_target(text, args.target)
        apply(target, args.batch, parse_variant(fields))
        try:
            ms, logits = time_step(step)
        finally:
            restore()
        again_ms, _ = time_step(step)
        table_ms = [round(base_ms, 4), round(again_ms, 4)]
        rows.append({"variant": text, "ms": round(ms, 4), "table_ms": table_ms,
                     "logits_equal": bool(torch.equal(logits, base_logits))})  # fmt: skip
        base_ms = again_ms
    moe_row = moe_tiles.decode_tiles_for(args.batch, torch.device("cuda"))
    dense_row = (
        f"GEMV_MAX_TOKENS={linear.GEMV_MAX_TOKENS},MMA_MAX_TOKENS={linear.MMA_MAX_TOKENS},"
        f"MMA_TILES={linear.MMA_TILES},QKV_MMA_TILES={rope.QKV_MMA_TILES},"
        f"QKV_MMA_MAX_TOKENS={rope.QKV_MMA_MAX_TOKENS},GEMV_TILES={linear.GEMV_TILES},"
        f"GEMV_TILES_WIDE={linear.GEMV_TILES_WIDE},GEMV_TILES_TALL={linear.GEMV_TILES_TALL},"
        f"GEMV_TILES_WIDE_PAIR={linear.GEMV_TILES_WIDE_PAIR}"
    )
    norm_row = f"WIDE_ROW_WARPS={norm.WIDE_ROW_WARPS}"
    table_row = {"attention": attention.gpu_tiles_for(args.batch), "dense": dense_row,
                 "norm": norm_row}.get(args.target, moe_row)  # fmt: skip
    write_results(args.out, batch=args.batch, context=args.context, target=args.target,
                  table_row=str(table_row), rows=rows)  # fmt: skip
    sys.stdout.write(f"\nwhole step, batch {args.batch}, context {args.context} (ms)\n")
    sys.stdout.write(f"{'variant':60} {'ms':>8} {'table before/after':>20} logits\n")
    for row in rows:
        before, after = row["table_ms"]
        same = "same" if row["logits_equal"] else "differ"
        sys.stdout.write(
            f"{row['variant']:60} {row['ms']:8.4f} {before:9.4f} {after:9.4f}  {same}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
