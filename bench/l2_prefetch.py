"""Does pulling the next weights into L2 ahead of their kernel pay? (H200, 120b shapes, batch 1)

    python bench/l2_prefetch.py [--out bench/results/l2_prefetch.json]

Per stage (36 layers' calls in one CUDA graph, us): "cold" reads every layer's own weights
(as the step does), "hot" the same layer's 36 times (L2-resident: the bound a prefetch can
reach), "pf same" prefetches a call's weights right before it, "pf ahead" the next call's
(pipelined), "pf side" the next call's from a second stream. Then the whole decode step with
prefetches on a side stream at the points where the step leaves HBM idle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_model import DecodeStep, _normal

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.linear import linear
from gptoss_serve.kernels.moe import MoeWeights, route, router_logits_reference
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.prefetch import l2_prefetch
from gptoss_serve.kernels.rope import rope_and_cache_write
from gptoss_serve.kernels.sampling import sample_tokens
from kernels import commit, graph_time_ms

logger = logging.getLogger("bench.l2_prefetch")
TOP_K = 4


def us(fn: Callable[[], object]) -> float:
    return statistics.median(graph_time_ms(fn, repeats=20)) * 1e3


def pipelined(calls: list[Callable[[], object]], fetches: list[Callable[[], object]], mode: str,
              side: torch.cuda.Stream) -> Callable[[], None]:  # fmt: skip
    """Run calls[i] for every i with fetches[j] (the prefetch of call j's weights) per mode."""

    def run() -> None:
        n = len(calls)
        main = torch.cuda.current_stream()
        if mode == "ahead":
            fetches[0]()
        for i in range(n):
            if mode == "same":
                fetches[i]()
            elif mode == "ahead" and i + 1 < n:
                fetches[i + 1]()
            elif mode == "side":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if i == 0:
                        fetches[0]()
                    if i + 1 < n:
                        fetches[i + 1]()
            calls[i]()
        if mode == "side":
            main.wait_stream(side)

    return run


def expert_fetch(moe: MoeWeights, ids: torch.Tensor, parts: str = "gate_up,down") -> Callable:
    def fetch() -> None:
        flat = ids.view(-1)
        if "gate_up" in parts:
            l2_prefetch(moe.gate_up_blocks, flat)
            l2_prefetch(moe.gate_up_scales, flat)
        if "down" in parts:
            l2_prefetch(moe.down_blocks, flat)
            l2_prefetch(moe.down_scales, flat)

    return fetch


def stage_rows(step: DecodeStep, side: torch.cuda.Stream) -> list[dict]:
    config = step.config
    attns = [layer.attention for layer in step.weights.layers]
    moes = [layer.moe for layer in step.weights.layers]
    x = step.hidden
    attn_out = _normal((1, config.q_dim), 1.0, "cuda")
    rows = []
    dense = {
        "qkv": (x, [(a.qkv_weight, a.qkv_bias) for a in attns]),
        "o": (attn_out, [(a.o_weight, a.o_bias) for a in attns]),
    }
    for name, (inp, ws) in dense.items():
        nbytes = sum(w.numel() * 2 for w, _ in ws)
        calls = [lambda w=w, b=b, inp=inp: linear(inp, w, b) for w, b in ws]
        fetches = [lambda w=w: l2_prefetch(w) for w, _ in ws]
        hot = [lambda w=ws[0][0], b=ws[0][1], inp=inp: linear(inp, w, b)] * len(ws)
        variants = {
            "cold": lambda calls=calls: [c() for c in calls],
            "hot": lambda hot=hot: [c() for c in hot],
        }
        for mode in ("same", "ahead", "side"):
            variants[f"pf {mode}"] = pipelined(calls, fetches, mode, side)
        variants["prefetch alone"] = lambda fetches=fetches: [f() for f in fetches]
        for variant, fn in variants.items():
            t = us(fn)
            rows.append({"stage": name, "variant": variant, "us": round(t, 1),
                         "tbps": round(nbytes / (t * 1e-6) / 1e12, 3)})  # fmt: skip
            logger.info("%s", rows[-1])
    # MoE at T = 1 with a given routing (the reference's), gate_up + down only.
    xs = [_normal((1, config.hidden_size), 1.0, "cuda") for _ in moes]
    routing = [route(router_logits_reference(x_, m), TOP_K) for x_, m in zip(xs, moes, strict=True)]
    outs = [torch.empty_like(x_) for x_ in xs]
    tiles = small.decode_tiles_for(1)
    calls = [
        lambda i=i: small.mxfp4_moe_decode(
            xs[i],
            moes[i],
            expert_ids=routing[i][1],
            routing_weights=routing[i][0],
            out=outs[i],
            tiles=tiles,
        )
        for i in range(len(moes))
    ]
    hot = [calls[0]] * len(moes)
    nbytes = len(moes) * 4 * 13_236_480
    for parts in ("gate_up,down", "down"):
        fetches = [expert_fetch(m, routing[i][1], parts) for i, m in enumerate(moes)]
        variants = {} if parts == "down" else {
            "cold": lambda: [c() for c in calls], "hot": lambda: [c() for c in hot],
            "prefetch alone": lambda fetches=fetches: [f() for f in fetches],
        }  # fmt: skip
        for mode in ("same", "ahead", "side"):
            variants[f"pf {mode} ({parts})"] = pipelined(calls, fetches, mode, side)
        for variant, fn in variants.items():
            t = us(fn)
            rows.append({"stage": "moe T=1", "variant": variant, "us": round(t, 1),
                         "tbps": round(nbytes / (t * 1e-6) / 1e12, 3)})  # fmt: skip
            logger.info("%s", rows[-1])
    return rows


class PrefetchStep:
    """DecodeStep's step with the MoE routed in the router, and side-stream prefetches:
    "o": each layer's o weight after its qkv GEMV (during RoPE and attention); "qkv": the
    next layer's q/k/v weight after the router; "experts": the routed experts' weights after
    the router (gate_up and down); "down": only their down weights."""

    def __init__(self, step: DecodeStep, fetch: set[str], side: torch.cuda.Stream) -> None:
        self.step, self.fetch, self.side = step, fetch, side
        config = step.config
        h, e, i = config.hidden_size, config.num_local_experts, config.intermediate_size
        self.tiles = dataclasses.replace(small.decode_tiles_for(1), route_in_router=True)
        dev = "cuda"
        self.logits = torch.empty(1, e, device=dev)
        self.x_thread = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
        self.ids = torch.empty(1, TOP_K, dtype=torch.int32, device=dev)
        self.gates = torch.empty(1, TOP_K, device=dev)
        self.h = torch.empty(TOP_K, i, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)

    def _side(self, fn: Callable[[], None]) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            fn()

    def __call__(self) -> torch.Tensor:
        step, config = self.step, self.step.config
        a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        layers = step.weights.layers
        x, residual = step.hidden, None
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(layers, step.caches, strict=True)):
            attn, moe = layer.attention, layer.moe
            normed, residual = fused_add_rms_norm(x, residual, attn.input_norm, config.rms_norm_eps)
            qkv = linear(normed, attn.qkv_weight, attn.qkv_bias)
            if "o" in self.fetch:
                self._side(lambda attn=attn: l2_prefetch(attn.o_weight))
            q, k, v = qkv.split([config.q_dim, config.kv_dim, config.kv_dim], dim=-1)
            q = rope_and_cache_write(
                q.view(1, a, d), k.view(1, kv, d), v.view(1, kv, d), step.positions,
                step.weights.inv_freq, config.rope.attention_scaling, k_cache, v_cache,
                step.slot_mapping,
            )  # fmt: skip
            window = config.sliding_window if config.is_sliding(index) else None
            out = paged_attention_decode(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                         attn.sinks, window=window, scale=d**-0.5)  # fmt: skip
            x = linear(out.view(1, config.q_dim), attn.o_weight, attn.o_bias)
            normed, residual = fused_add_rms_norm(x, residual, attn.post_norm, config.rms_norm_eps)
            small.launch_router(normed, moe, self.logits, self.x_thread, self.tiles, ids=self.ids,
                                gates=self.gates)  # fmt: skip

            def after_router(moe: MoeWeights = moe, index: int = index) -> None:
                if "experts" in self.fetch or "down" in self.fetch:
                    parts = "gate_up,down" if "experts" in self.fetch else "down"
                    expert_fetch(moe, self.ids, parts)()
                if "qkv" in self.fetch and index + 1 < len(layers):
                    l2_prefetch(layers[index + 1].attention.qkv_weight)

            if self.fetch & {"experts", "down", "qkv"}:
                self._side(after_router)
            small.launch_gate_up(moe, self.x_thread, None, self.ids, self.gates, h=self.h,
                                 tiles=self.tiles)  # fmt: skip
            small.launch_down(moe, self.h, self.ids, self.gates, out=self.out, tiles=self.tiles)
            x = self.out
        if self.fetch:  # joined only when forked (capture rejects a join with nothing forked)
            torch.cuda.current_stream().wait_stream(self.side)
        normed, _ = fused_add_rms_norm(x, residual, step.weights.final_norm, config.rms_norm_eps)
        logits = linear(normed, step.weights.lm_head, out_dtype=torch.float32)
        return sample_tokens(logits, step.temperature, step.top_p, step.seeds, step.steps)


def step_rows(step: DecodeStep, side: torch.cuda.Stream) -> list[dict]:
    rows = [{"stage": "step", "variant": "DecodeStep", "us": round(us(step), 1), "tbps": None}]
    logger.info("%s", rows[-1])
    fetches = [[], ["o"], ["qkv"], ["down"], ["o", "qkv"], ["o", "down"], ["o", "qkv", "down"],
               ["experts"], ["o", "experts"], ["o", "qkv", "experts"]]  # fmt: skip
    for fetch in fetches:
        t = us(PrefetchStep(step, set(fetch), side))
        rows.append({"stage": "step", "variant": "+".join(fetch) or "routed in router",
                     "us": round(t, 1), "tbps": None})  # fmt: skip
        logger.info("%s", rows[-1])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results/l2_prefetch.json")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    step = DecodeStep(config, batch=1, context=1024)
    side = torch.cuda.Stream()
    rows = stage_rows(step, side) + step_rows(step, side)
    result = {"device": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(f"\n{result['device']}  commit {result['commit'][:10]}\n")
    for r in rows:
        sys.stdout.write(f"{r['stage']:8} {r['variant']:32} {r['us']:9.1f} us  {r['tbps']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
