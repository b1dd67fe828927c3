"""Does the batch-1 decode step gain from pulling the next dense weights into L2 while HBM idles?

    python bench/l2_prefetch_probe.py [--out bench/results/l2_prefetch_probe.json]

At batch 1 the step reads ~5 GB in ~2.45 ms, 1.16 ms at the copy rate: HBM idles through the
attention kernels, the norms, the router and the MoE's latency-bound GEMVs. Here one extra
1-program kernel per prefetch point issues ``cp.async.bulk.prefetch.L2`` for a weight (fire and
forget; PDL: it lets the next kernel in at once and waits for its predecessor before it exits,
so the chain's ordering holds) and the whole step (PDL, CUDA graph, as kernels.py times it) is
timed under each set of points, interleaved with the plain step. Points (layer L):

- ``o@attn``: o(L) just before attention(L); ``o@qkv``: o(L) before qkv(L)
- ``qkv@moe``: qkv(L + 1) before the MoE(L); ``qkv@post``: qkv(L + 1) after the MoE(L)
- ``empty``: the extra kernels with nothing to fetch (their launch cost alone)

Also: one o / q/k/v GEMV when its weights are in L2 (the same weight 36 times) against cold
(36 layers' weights), per call.
"""

# Triton's conventions: UPPER_CASE constexpr parameters.
# ruff: noqa: N803
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_model import DecodeStep
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.linear import linear
from gptoss_serve.kernels.moe import mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.sampling import sample_tokens
from kernels import graph_time_ms, write_results

logger = logging.getLogger("bench.l2_prefetch_probe")
CHUNK = 16384  # bytes per cp.async.bulk.prefetch.L2


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    """Program p: L2 prefetch of chunks [p·CHUNKS, (p + 1)·CHUNKS) of the nbytes at ptr."""
    if PDL:
        gdc_launch_dependents()
    chunk = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    offsets = chunk.to(tl.int64) * CHUNK_BYTES
    sizes = tl.minimum(nbytes - offsets, CHUNK_BYTES).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; mov.u32 $0, 0;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; }",
        "=r,l,r",
        [ptr + offsets, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    if PDL:
        gdc_wait()


class Prefetcher:
    """Launches the prefetch kernel: on the step's stream (PDL), or on its own side stream,
    forked from the step's at each launch and joined by ``join``."""

    def __init__(self) -> None:
        self.dummy = torch.zeros(16, dtype=torch.uint8, device="cuda")
        self.side = torch.cuda.Stream()

    def __call__(self, tensor: torch.Tensor | None, programs: int = 1, side: bool = False) -> None:
        """L2 prefetch of ``tensor``'s bytes over ``programs`` programs (None: the kernel with
        nothing to fetch); ``side``: on the side stream."""
        if tensor is None:
            _prefetch_kernel[(1,)](self.dummy, 0, CHUNKS=16, CHUNK_BYTES=CHUNK, PDL=True,
                                   num_warps=4, launch_pdl=True)  # fmt: skip
            return
        nbytes = tensor.numel() * tensor.element_size()
        chunks = triton.next_power_of_2(-(-nbytes // (CHUNK * programs)))
        args = (tensor.view(torch.uint8).view(-1), nbytes)
        if side:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                _prefetch_kernel[(programs,)](*args, CHUNKS=chunks, CHUNK_BYTES=CHUNK,
                                              PDL=False, num_warps=4)  # fmt: skip
            return
        _prefetch_kernel[(programs,)](*args, CHUNKS=chunks, CHUNK_BYTES=CHUNK, PDL=True,
                                      num_warps=4, launch_pdl=True)  # fmt: skip

    def at(self, points: frozenset, name: str, tensor: torch.Tensor | None) -> None:
        """Prefetch ``tensor`` if point ``name`` is on, in any of its forms (plain, /132,
        /side)."""
        if tensor is None:
            return
        if name in points:
            self(tensor)
        if f"{name}/132" in points:
            self(tensor, programs=132)
        if f"{name}/side" in points:
            self(tensor, programs=132, side=True)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)


class PrefetchStep(DecodeStep):
    """DecodeStep (triton, PDL) with ``prefetcher``'s kernels at ``points``."""

    def __init__(self, prefetcher: Prefetcher, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefetcher = prefetcher
        self.points: frozenset = frozenset()

    def __call__(self) -> torch.Tensor:
        config, weights = self.config, self.weights
        d, q_dim = config.head_dim, config.q_dim
        x, residual, points, fetch = self.hidden, None, self.points, self.prefetcher
        layers = weights.layers
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(layers, self.caches, strict=True)):
            attn = layer.attention
            nxt = layers[index + 1].attention.qkv_weight if index + 1 < len(layers) else None
            normed, residual = fused_add_rms_norm(
                x, residual, attn.input_norm, config.rms_norm_eps, pdl=True
            )
            fetch.at(points, "o@qkv", attn.o_weight)
            q = self._qkv_rope(attn, normed, k_cache, v_cache, {"pdl": True})
            fetch.at(points, "o@attn", attn.o_weight)
            if "empty" in points:
                fetch(None)
            window = config.sliding_window if config.is_sliding(index) else None
            out = paged_attention_decode(
                q, k_cache, v_cache, self.block_tables, self.seq_lens, attn.sinks,
                window=window, scale=d**-0.5, pdl=True,
            )  # fmt: skip
            x = linear(out.view(-1, q_dim), attn.o_weight, attn.o_bias, pdl=True)
            normed, residual = fused_add_rms_norm(
                x, residual, attn.post_norm, config.rms_norm_eps, pdl=True
            )
            fetch.at(points, "qkv@moe", nxt)
            if "empty" in points:
                fetch(None)
            x = mxfp4_moe(normed, layer.moe, top_k=config.num_experts_per_tok, pdl=True)
            fetch.at(points, "qkv@post", nxt)
        normed, _ = fused_add_rms_norm(
            x, residual, weights.final_norm, config.rms_norm_eps, pdl=True
        )
        logits = linear(normed, weights.lm_head, out_dtype=torch.float32, pdl=True)
        if any("/side" in p for p in points):
            fetch.join()
        self.last_logits = logits
        return sample_tokens(logits, self.temperature, self.top_p, self.seeds, self.steps)


def gemv_l2(step: DecodeStep) -> list[dict]:
    """us per call of the o and q/k/v GEMVs: cold (36 layers' weights) and warm (one weight)."""
    rows = []
    config = step.config
    x = {"o": torch.randn(1, config.q_dim, device="cuda").bfloat16(),
         "qkv": torch.randn(1, config.hidden_size, device="cuda").bfloat16()}  # fmt: skip
    for name in ("o", "qkv"):
        ws = [getattr(layer.attention, f"{name}_weight") for layer in step.weights.layers]
        bs = [getattr(layer.attention, f"{name}_bias") for layer in step.weights.layers]
        for mode in ("cold", "warm"):
            pairs = list(zip(ws, bs, strict=True)) if mode == "cold" else [(ws[0], bs[0])] * 36
            times = graph_time_ms(
                lambda pairs=pairs, name=name: [linear(x[name], w, b, pdl=True) for w, b in pairs],
                calls=36, repeats=30,
            )  # fmt: skip
            us = statistics.median(times) * 1e3
            mb = ws[0].numel() * 2 / 1e6
            rows.append({"gemv": name, "mode": mode, "us": round(us, 2),
                         "tbps": round(mb / us, 3)})  # fmt: skip
    return rows


VARIANTS = [
    ("empty",),
    ("o@attn",),
    ("o@qkv",),
    ("qkv@moe",),
    ("qkv@post",),
    ("o@attn", "qkv@moe"),
    ("o@attn", "qkv@post"),
    ("o@attn/132",),
    ("o@attn/side",),
    ("o@qkv/side",),
    ("qkv@moe/side",),
    ("qkv@post/side",),
    ("o@attn/side", "qkv@moe/side"),
    ("o@attn/side", "qkv@post/side"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/l2_prefetch_probe.json"))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    step = PrefetchStep(Prefetcher(), config, batch=1, context=args.context, pdl=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    logger.info("L2 %.1f MB", l2 / 1e6)
    gemv = gemv_l2(step)
    for row in gemv:
        logger.info("%s", row)
    results: dict[str, list[float]] = {}
    logits = {}
    for _ in range(args.rounds):
        for variant in [(), *VARIANTS]:
            step.points = frozenset(variant)
            times = graph_time_ms(step, repeats=30)
            results.setdefault("+".join(variant) or "plain", []).append(statistics.median(times))
            logits["+".join(variant) or "plain"] = step.last_logits.clone()
            step.points = frozenset()
            times = graph_time_ms(step, repeats=30)
            results["plain"].append(statistics.median(times))
    same = {name: bool(torch.equal(v, logits["plain"])) for name, v in logits.items()}
    table = [{"variant": name, "ms": [round(t, 4) for t in ts],
              "median_ms": round(statistics.median(ts), 4), "logits_equal": same[name]}
             for name, ts in results.items()]  # fmt: skip
    sys.stdout.write(f"\n{'variant':24} {'median ms':>10}  runs\n")
    for row in table:
        sys.stdout.write(
            f"{row['variant']:24} {row['median_ms']:10.4f}  {row['ms']}  {row['logits_equal']}\n"
        )
    write_results(args.out, l2_bytes=l2, context=args.context, gemv=gemv, steps=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
