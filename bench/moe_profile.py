"""MoE decode-path profile on the GPU (H200): the time, bytes and TB/s of every stage at
T = 1..64, the grouped path's stages beside them, and a sweep of the decode tiles.

    python bench/moe_profile.py [--out bench/results/moe_profile.json]
                                [--tokens 1,2,4,8,16,32,64] [--sweep-tokens 1,4,16,64] [--quick]
    ncu ... python bench/moe_profile.py --ncu default,u2,u4    (launches only; see ncu_launches)

Random 120b-shaped weights drawn on the GPU (E = 128, H = I = 2880, top-4). Every figure is the
median of CUDA-graph replays of 36 calls on 36 different random inputs (36 layers' worth of
calls, so the experts change from call to call), as in bench/kernels.py. Bytes: the distinct
experts' blocks + scales + biases that the stage reads (gate_up: 2I rows, down: H rows), the
router's 0.74 MB; TB/s = bytes / median time. The copy ceiling is measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import _normal, random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels import _moe_triton as grouped
from gptoss_serve.kernels._moe_columns import GROUP_SIZES
from gptoss_serve.kernels.moe import MoeWeights, route, router_logits_reference
from kernels import commit, copy_tbps, graph_time_ms

logger = logging.getLogger("bench.moe_profile")
CALLS = 36
TOP_K = 4
DEVICE = "cuda"
# (rows, split, warps, stages, unroll) of gate_up and down: the defaults first, then the
# alternatives. v2 (commit d6597e1) measured the first eight of each at unroll 1: 1-warp
# programs and 1-tile-per-warp ones lose; unroll > 1 asks HBM for 64·unroll contiguous bytes of
# a row at once (at T ≥ 4 both kernels sat at ~2.0 TB/s of HBM whatever the tile).
# v3 adds more, shorter programs (split 4, 16-row tiles), which pay once the routing is no
# longer recomputed in every program.
GATE_UP_VARIANTS = [
    (32, 2, 2, 4, 1), (64, 2, 2, 4, 1), (64, 2, 2, 2, 2), (16, 2, 2, 4, 1), (16, 4, 2, 4, 1),
    (32, 4, 4, 4, 1), (8, 4, 2, 4, 1), (16, 4, 2, 3, 2), (32, 2, 4, 4, 1), (16, 2, 1, 4, 1),
    (32, 2, 2, 6, 1), (32, 2, 2, 8, 1), (64, 2, 2, 6, 1), (32, 2, 2, 4, 2), (32, 1, 2, 8, 1),
    (32, 2, 2, 3, 1), (64, 2, 4, 3, 1), (16, 4, 2, 3, 1),
]  # fmt: skip
DOWN_VARIANTS = [
    (8, 2, 4, 4, 1), (16, 2, 4, 4, 1), (16, 1, 2, 4, 1), (4, 2, 2, 4, 1), (4, 4, 4, 4, 1),
    (8, 4, 4, 4, 1), (4, 4, 2, 4, 1), (8, 2, 2, 4, 1), (2, 4, 2, 4, 1), (8, 1, 2, 4, 1),
    (8, 2, 4, 6, 1), (8, 2, 4, 8, 1), (16, 2, 4, 6, 1), (8, 2, 4, 4, 2), (8, 1, 4, 8, 1),
    (8, 2, 4, 3, 1), (8, 2, 2, 3, 1), (4, 4, 2, 3, 1), (8, 4, 2, 3, 1), (8, 4, 4, 3, 1),
]  # fmt: skip


@dataclasses.dataclass
class Case:
    """36 inputs of T tokens and their decode-path intermediates (one set of buffers each)."""

    xs: list[torch.Tensor]
    logits: list[torch.Tensor]
    x_thread: list[torch.Tensor]
    ids: list[torch.Tensor]
    gates: list[torch.Tensor]
    h: list[torch.Tensor]
    outs: list[torch.Tensor]
    distinct: float  # mean distinct experts per call (reference routing)


def make_case(weights: MoeWeights, tokens: int, calls: int | None = None) -> Case:
    calls = calls or CALLS
    h_dim, i_dim, e = weights.hidden_size, weights.intermediate_size, weights.num_experts
    xs = [_normal((tokens, h_dim), 1.0, DEVICE) for _ in range(calls)]

    def empty(*shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(calls)]

    tiles = small.decode_tiles_for(tokens)
    case = Case(
        xs,
        empty(tokens, e, dtype=torch.float32),
        empty(tokens, small.row_width(h_dim, tiles.tile_order), dtype=torch.bfloat16),
        empty(tokens, TOP_K, dtype=torch.int32),
        empty(tokens, TOP_K, dtype=torch.float32),
        empty(tokens * TOP_K, small.row_width(i_dim, tiles.tile_order), dtype=torch.bfloat16),
        empty(tokens, h_dim, dtype=torch.bfloat16),
        statistics.mean(
            torch.unique(route(router_logits_reference(x, weights), TOP_K)[1]).numel() for x in xs
        ),
    )
    for i in range(calls):  # fill every intermediate once, so each stage can run alone
        small.launch_router(xs[i], weights, case.logits[i], case.x_thread[i], tiles,
                            ids=case.ids[i] if small.routes_in_router(tiles) else None,
                            gates=case.gates[i])  # fmt: skip
        if not tiles.group_columns:
            gate_up(weights, case, i, tiles)
    torch.cuda.synchronize()
    return case


def stage_bytes(weights: MoeWeights, case: Case) -> dict[str, float]:
    h, i, e = weights.hidden_size, weights.intermediate_size, weights.num_experts
    gate_up = case.distinct * 2 * i * (h // 2 + h // 32 + 2)
    down = case.distinct * h * (i // 2 + i // 32 + 2)
    router = 2 * e * h + 2 * e
    return {"router": router, "gate_up": gate_up, "down": down, "columns": gate_up + down,
            "total": router + gate_up + down}  # fmt: skip


def timed(fn: Callable[[int], object]) -> float:
    """Median µs per call of ``fn(i)`` over graph replays of the 36 calls."""
    times = graph_time_ms(lambda: [fn(i) for i in range(CALLS)], calls=CALLS, repeats=20)
    return statistics.median(times) * 1e3


def decode_stages(weights: MoeWeights, case: Case, tiles: small.DecodeTiles) -> dict[str, float]:
    return (
        {
            "router": timed(
                lambda i: small.launch_router(
                    case.xs[i],
                    weights,
                    case.logits[i],
                    case.x_thread[i],
                    tiles,
                    ids=case.ids[i] if small.routes_in_router(tiles) else None,
                    gates=case.gates[i],
                )
            ),
        }
        | experts_stages(weights, case, tiles)
        | {
            "total": timed(lambda i: small.mxfp4_moe_decode(case.xs[i], weights, tiles=tiles)),
        }
    )


def experts_stages(weights: MoeWeights, case: Case, tiles: small.DecodeTiles) -> dict:
    """The per-pair path's two GEMVs, or the grouped columns' launches after the router."""
    if not tiles.group_columns:
        return {
            "gate_up": timed(lambda i: gate_up(weights, case, i, tiles)),
            "down": timed(lambda i: down(weights, case, i, tiles)),
        }
    return {"columns": timed(lambda i: columns(weights, case, i, tiles))}


def gate_up(weights: MoeWeights, case: Case, i: int, tiles: small.DecodeTiles) -> None:
    logits = None if small.routes_in_router(tiles) else case.logits[i]  # None: ids/gates given
    small.launch_gate_up(
        weights, case.x_thread[i], logits, case.ids[i], case.gates[i], h=case.h[i], tiles=tiles
    )


def columns(weights: MoeWeights, case: Case, i: int, tiles: small.DecodeTiles) -> None:
    small.launch_columns(weights, case.x_thread[i], case.ids[i], case.gates[i], h=case.h[i],
                         out=case.outs[i], tiles=tiles)  # fmt: skip


def down(weights: MoeWeights, case: Case, i: int, tiles: small.DecodeTiles) -> None:
    small.launch_down(weights, case.h[i], case.ids[i], case.gates[i], out=case.outs[i], tiles=tiles)


def grouped_stages(weights: MoeWeights, case: Case) -> dict[str, float]:
    tokens = case.xs[0].shape[0]
    tiles = grouped.tiles_for(tokens, weights.num_experts)
    return {
        "route": timed(
            lambda i: grouped.route_triton(case.xs[i], weights, top_k=TOP_K, tiles=tiles)
        ),
        "experts": timed(
            lambda i: grouped.moe_experts_triton(
                case.xs[i], weights, case.ids[i], case.gates[i], tiles=tiles
            )
        ),
        "total": timed(
            lambda i: grouped.mxfp4_moe_triton(case.xs[i], weights, top_k=TOP_K, tiles=tiles)
        ),
    }


def max_rel_vs_grouped(weights: MoeWeights, case: Case) -> float:
    """Sanity: the decode path against the grouped one on the same routing (bf16-level)."""
    x, ids, gates = case.xs[0], case.ids[0], case.gates[0]
    tiles = grouped.tiles_for(x.shape[0], weights.num_experts)
    old = grouped.moe_experts_triton(x, weights, ids, gates, tiles=tiles).double()
    new = small.mxfp4_moe_decode(x, weights, expert_ids=ids, routing_weights=gates).out.double()
    return ((new - old).abs().max() / old.abs().max()).item()


def variant_tiles(gate_up_shape=None, down_shape=None, base=None) -> small.DecodeTiles:
    tiles = base or small.DecodeTiles()
    if gate_up_shape:
        rows, split, warps, stages, unroll = gate_up_shape
        tiles = dataclasses.replace(
            tiles, gate_up_rows=rows, gate_up_split=split, gate_up_warps=warps,
            gate_up_stages=stages, gate_up_unroll=unroll,
        )  # fmt: skip
    if down_shape:
        rows, split, warps, stages, unroll = down_shape
        tiles = dataclasses.replace(
            tiles, down_rows=rows, down_split=split, down_warps=warps, down_stages=stages,
            down_unroll=unroll,
        )  # fmt: skip
    return tiles


def sweep(weights: MoeWeights, case: Case, nbytes: dict, rows: list, report: list) -> dict:
    """Time every gate_up and down variant alone; returns the best DecodeTiles (as a dict)."""
    tokens = case.xs[0].shape[0]
    best: dict[str, tuple[float, tuple]] = {}
    for stage, variants in (("gate_up", GATE_UP_VARIANTS), ("down", DOWN_VARIANTS)):
        for shape in variants:
            tiles = variant_tiles(shape if stage == "gate_up" else None,
                                  shape if stage == "down" else None)  # fmt: skip
            fn = gate_up if stage == "gate_up" else down
            try:
                us = timed(lambda i, fn=fn, tiles=tiles: fn(weights, case, i, tiles))
            except Exception:  # a variant that does not build or launch: report, go on
                logger.exception("variant %s %s failed", stage, shape)
                report.append({"stage": stage, "tokens": tokens, "variant": shape, "error": True})
                continue
            tbps = nbytes[stage] / (us * 1e-6) / 1e12
            note = "rows,split,warps,stages,unroll=" + ",".join(map(str, shape))
            rows.append((f"sweep {stage}", tokens, us, nbytes[stage], tbps, note))
            report.append({"stage": stage, "tokens": tokens, "variant": shape, "us": us,
                           "tbps": tbps})  # fmt: skip
            if stage not in best or us < best[stage][0]:
                best[stage] = (us, shape)
    tiles = variant_tiles(best["gate_up"][1], best["down"][1])
    totals = {}
    for pdl in (False, True):  # programmatic dependent launch: down overlaps gate_up's tail
        candidate = dataclasses.replace(tiles, pdl=pdl)
        try:
            us = timed(lambda i, c=candidate: small.mxfp4_moe_decode(case.xs[i], weights, tiles=c))
        except Exception:
            logger.exception("total with pdl=%s failed", pdl)
            continue
        totals[pdl] = us
        rows.append((f"decode total, best tiles{', pdl' if pdl else ''}", tokens, us,
                     nbytes["total"], nbytes["total"] / (us * 1e-6) / 1e12, ""))  # fmt: skip
    if totals:
        tiles = dataclasses.replace(tiles, pdl=min(totals, key=totals.get))
    return dataclasses.asdict(tiles)


# The expert-grouped path (_moe_columns.py): (rows, warps, stages) of gate_up with the table's
# down, then of down with the best gate_up; each timed as the whole decode MoE.
COLUMNS_VARIANTS = [
    (32, 2, 4), (16, 1, 4), (16, 2, 4), (32, 1, 4), (32, 4, 4), (64, 2, 4), (64, 4, 4),
    (32, 2, 3), (32, 2, 6), (64, 2, 3), (128, 4, 4),
]  # fmt: skip


def sweep_columns(weights: MoeWeights, case: Case, nbytes: dict, rows: list, report: list) -> dict:
    """Tiles of the grouped-columns path, timed as the whole decode MoE: the group size, then
    (rows, warps, stages) of gate_up and of down, each stage keeping the best so far."""
    tokens = case.xs[0].shape[0]
    best = small.decode_tiles_for(tokens)
    stages = [("group", [(size,) for size in GROUP_SIZES])]
    stages += [(stage, COLUMNS_VARIANTS) for stage in ("gate_up", "down")]
    for stage, shapes in stages:
        timings = {}
        for shape in shapes:
            if stage == "group":
                fields = {"group_size": shape[0]}
            else:
                r, w, st = shape
                fields = {f"{stage}_rows": r, f"{stage}_warps": w, f"{stage}_stages": st}
            tiles = dataclasses.replace(best, **fields)
            us = timed(lambda i, t=tiles: small.mxfp4_moe_decode(case.xs[i], weights, tiles=t))
            timings[shape] = (us, tiles)
            note = f"columns {stage} " + ",".join(fields) + "=" + ",".join(map(str, shape))
            rows.append(("sweep columns", tokens, us, nbytes["total"],
                         nbytes["total"] / (us * 1e-6) / 1e12, note))  # fmt: skip
            report.append({"stage": f"columns {stage}", "tokens": tokens, "variant": shape,
                           "us": us})  # fmt: skip
        best = min(timings.values(), key=lambda pair: pair[0])[1]
    return dataclasses.asdict(best)


def ncu_launches(weights: MoeWeights, variants: list[str]) -> None:
    """For Nsight Compute: each decode kernel launched twice at T = 1 and 16 for each tile
    variant ("default": the table's row, or "u<n>": gate_up and down unrolled n steps on
    max(2, 4 - n // 2) stages), the second launch inside
    an NVTX range "measure" (ncu --nvtx --nvtx-include "measure/"), in the printed order."""
    for tokens in (1, 16):
        case = make_case(weights, tokens, calls=1)
        for name in variants:
            tiles = small.decode_tiles_for(tokens)  # "default": the table's row as it is
            if name != "default":
                unroll = int(name[1:])
                tiles = dataclasses.replace(
                    tiles, gate_up_unroll=unroll, down_unroll=unroll,
                    gate_up_stages=max(2, 4 - unroll // 2), down_stages=max(2, 4 - unroll // 2),
                )  # fmt: skip
            for stage in ("gate_up", "down"):
                fn = gate_up if stage == "gate_up" else down
                fn(weights, case, 0, tiles)  # compiles
                torch.cuda.synchronize()
                with torch.cuda.nvtx.range("measure"):
                    fn(weights, case, 0, tiles)
                torch.cuda.synchronize()
                sys.stdout.write(f"ncu: T={tokens} {stage} {name} {tiles}\n")
        del case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(__file__).parent / "results/moe_profile.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--sweep-tokens", default="1,4,16,64")
    parser.add_argument("--quick", action="store_true", help="no copy ceiling, no grouped path")
    parser.add_argument("--ncu", default=None, help="only launch for ncu: e.g. default,u2,u4")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh data every run
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    if args.ncu:
        ncu_launches(weights, args.ncu.split(","))
        return 0
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "copy_tbps": None if args.quick else round(copy_tbps(), 3),
        "stages": [], "sweep": [], "best_tiles": {}, "max_rel_vs_grouped": {},
    }  # fmt: skip
    rows: list[tuple[str, int, float, float, float, str]] = []
    sweep_tokens = {int(t) for t in args.sweep_tokens.split(",") if t}
    for tokens in (int(t) for t in args.tokens.split(",")):
        logger.info("T = %d", tokens)
        case = make_case(weights, tokens)
        nbytes = stage_bytes(weights, case)
        results["max_rel_vs_grouped"][tokens] = max_rel_vs_grouped(weights, case)
        tiles = small.decode_tiles_for(tokens)
        for stage, us in decode_stages(weights, case, tiles).items():
            rows.append((f"decode {stage}", tokens, us, nbytes[stage],
                         nbytes[stage] / (us * 1e-6) / 1e12, ""))  # fmt: skip
        if not args.quick:
            old_bytes = {"route": nbytes["router"], "experts": nbytes["total"] - nbytes["router"]}
            old_bytes["total"] = nbytes["total"]
            for stage, us in grouped_stages(weights, case).items():
                rows.append((f"grouped {stage}", tokens, us, old_bytes[stage],
                             old_bytes[stage] / (us * 1e-6) / 1e12, ""))  # fmt: skip
        if tokens in sweep_tokens and tiles.group_columns:
            results["best_tiles"][tokens] = sweep_columns(weights, case, nbytes, rows,
                                                          results["sweep"])  # fmt: skip
        elif tokens in sweep_tokens:
            results["best_tiles"][tokens] = sweep(weights, case, nbytes, rows, results["sweep"])
        del case
        torch.cuda.empty_cache()
    results["stages"] = [
        {"stage": s, "tokens": t, "us": round(us, 2), "bytes": int(b), "tbps": round(r, 3),
         "note": n}
        for s, t, us, b, r, n in rows
    ]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    out = sys.stdout
    out.write(f"\n{results['device']}  commit {results['commit'][:10]}  {results['date']}  ")
    out.write(f"copy ceiling {results['copy_tbps']} TB/s\n")
    out.write(f"{'stage':32} {'T':>3} {'us':>9} {'MB':>8} {'TB/s':>6}  note\n")
    for stage, tokens, us, nbytes, tbps, note in rows:
        out.write(f"{stage:32} {tokens:3d} {us:9.2f} {nbytes / 1e6:8.2f} {tbps:6.3f}  {note}\n")
    out.write(f"decode vs grouped, max_rel: {results['max_rel_vs_grouped']}\n")
    totals = {(r["stage"], r["tokens"]): r["us"] for r in results["stages"]}
    for tokens in sorted({t for _, t in totals}):
        new, old = totals.get(("decode total", tokens)), totals.get(("grouped total", tokens))
        if new and old:  # where DECODE_MAX_TOKENS should sit
            out.write(f"T={tokens}: decode path {new:.1f} us, grouped {old:.1f} us\n")
    for tokens, tiles in results["best_tiles"].items():
        out.write(f"best tiles T={tokens}: {tiles}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
