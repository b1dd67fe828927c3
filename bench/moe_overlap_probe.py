"""Would one launch that streams gate_up and down together beat the two launches in a row?
(H200; batch 1 to 8)

The decode MoE at T = 1 is two short GEMV launches a layer (gate_up 33 MB, down 17 MB), each
of which fills the SMs, streams, and drains before the next starts (PDL lets the next one in
only after the GEMV loops: RESULTS v8/v9). v9's bare-stream probe found ~3 us of ramp and
tail per ~33 MB launch. Before building a fused kernel (down's K parts waiting on the gate_up
tiles that produce them), this measures what overlapping the two could give at all: the same
kernels on the same routed experts, 36 layers in one CUDA graph, as

- ``seq``: gate_up then down, a layer after the other (the engine's order), plain or PDL;
- ``gate_up`` / ``down``: each alone, 36 in a row;
- ``par``: each layer's gate_up and down forked onto two streams of the graph, joined before
  the next layer (down reads an h written before: timing only). If ``par`` is near
  max(gate_up, down), the SMs and HBM have room to run both at once and a fused kernel could
  win up to seq - par; if it is near seq, the two streams only share what one had.

    cd bench && python3 moe_overlap_probe.py [--tokens 1 4 8] [--out results/moe_overlap_probe.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch
from gpu_model import random_moe_weights
from moe_profile import CALLS, down, gate_up, make_case, stage_bytes

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from kernels import commit, graph_time_ms


def _two_streams(weights, case, tiles, streams: tuple[torch.cuda.Stream, ...]) -> None:
    """Every layer's gate_up and down on ``streams`` (two, forked from the current one),
    joined before the next layer."""
    main = torch.cuda.current_stream()
    for i in range(CALLS):
        for stream in streams:
            stream.wait_stream(main)
        with torch.cuda.stream(streams[0]):
            gate_up(weights, case, i, tiles)
        with torch.cuda.stream(streams[1]):
            down(weights, case, (i + 1) % CALLS, tiles)
        for stream in streams:
            main.wait_stream(stream)


def _timed(fn) -> float:
    """Median us per layer over 20 replays of the graph of 36 layers."""
    return statistics.median(graph_time_ms(fn, calls=CALLS, repeats=20)) * 1e3


def run(tokens: int, weights) -> dict:
    plain = small.decode_tiles_for(tokens)
    if plain.group_columns:
        raise SystemExit(f"{tokens} tokens take the grouped columns, not the two GEMVs")
    pdl = dataclasses.replace(plain, pdl=True)
    case = make_case(weights, tokens)
    nbytes = stage_bytes(weights, case)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    rounds = []
    for _ in range(2):  # two interleaved rounds: the clock moves between runs
        rounds.append({
            "seq_plain": _timed(lambda: [(gate_up(weights, case, i, plain),
                                          down(weights, case, i, plain)) for i in range(CALLS)]),
            "seq_pdl": _timed(lambda: [(gate_up(weights, case, i, pdl),
                                        down(weights, case, i, pdl)) for i in range(CALLS)]),
            "gate_up_pdl": _timed(lambda: [gate_up(weights, case, i, pdl) for i in range(CALLS)]),
            "down_pdl": _timed(lambda: [down(weights, case, i, pdl) for i in range(CALLS)]),
            "par_plain": _timed(lambda: _two_streams(weights, case, plain, streams)),
        })  # fmt: skip
    figures = {key: [round(r[key], 2) for r in rounds] for key in rounds[0]}
    experts_bytes = nbytes["gate_up"] + nbytes["down"]
    return {
        "tokens": tokens,
        "us_per_layer": figures,
        "gate_up_down_bytes": experts_bytes,
        "tbps": {key: round(experts_bytes / (min(v) * 1e-6) / 1e12, 3)
                 for key, v in figures.items() if key.startswith(("seq", "par"))},
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path("results/moe_overlap_probe.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = random_moe_weights(ModelConfig.from_dict(preset_config("120b")))
    results = [run(tokens, weights) for tokens in args.tokens]
    out = sys.stdout
    out.write(f"{'T':>3} " + " ".join(f"{key:>14}" for key in results[0]["us_per_layer"]) + "\n")
    for r in results:
        cells = " ".join(f"{'/'.join(f'{v:.1f}' for v in vs):>14}"
                         for vs in r["us_per_layer"].values())  # fmt: skip
        out.write(f"{r['tokens']:>3} {cells}   (us a layer, two rounds)  TB/s {r['tbps']}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "results": results,
    }, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
