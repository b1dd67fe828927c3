"""Programmatic dependent launch (kernels/launch.py): the decode step's kernels launched with
PDL give bit for bit what plain launches give, eagerly and replayed from a CUDA graph, in a
chain of two 120b-shaped layers (norm, q/k/v GEMV, RoPE + cache write, decode attention, o
GEMV, norm, MoE decode path) where each kernel reads what the one before wrote. Off the GPU
``pdl=True`` changes nothing."""

from __future__ import annotations

import pytest
import torch
from moe_cases import fresh_seed, random_weights

from gptoss_serve.kernels.attention import paged_attention_decode
from gptoss_serve.kernels.launch import pdl_applies
from gptoss_serve.kernels.linear import linear
from gptoss_serve.kernels.moe import mxfp4_moe
from gptoss_serve.kernels.norm import fused_add_rms_norm
from gptoss_serve.kernels.rope import rope_and_cache_write, split_qkv

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2880, 64, 8, 64, 16


def test_pdl_is_ignored_off_the_gpu() -> None:
    x = torch.randn(3, 64)
    assert not pdl_applies(True, x)
    weight = torch.randn(32, 64)
    assert torch.equal(linear(x, weight, pdl=True), linear(x, weight))
    gain = torch.rand(64)
    with_pdl = fused_add_rms_norm(x, x, gain, 1e-5, pdl=True)
    plain = fused_add_rms_norm(x, x, gain, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(with_pdl, plain, strict=True))


class _Chain:
    """Two layers' worth of the decode step's kernels over static buffers (graph-capturable);
    ``run(pdl)`` returns every layer's outputs."""

    def __init__(self, batch: int, context: int, seed: int) -> None:
        generator = torch.Generator("cuda").manual_seed(seed)

        def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
            return (torch.randn(shape, device="cuda", generator=generator) * std).to(torch.bfloat16)

        q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.layers = []
        for index in range(2):
            self.layers.append(
                dict(
                    norm1=1 + normal(HIDDEN, std=0.1),
                    norm2=1 + normal(HIDDEN, std=0.1),
                    qkv=normal(q_dim + 2 * kv_dim, HIDDEN, std=HIDDEN**-0.5),
                    qkv_bias=normal(q_dim + 2 * kv_dim, std=0.1),
                    o=normal(HIDDEN, q_dim, std=q_dim**-0.5),
                    o_bias=normal(HIDDEN, std=0.1),
                    sinks=normal(HEADS),
                    moe=random_weights(128, HIDDEN, HIDDEN, device="cuda", seed=seed + index),
                )
            )
        blocks = batch * -(-context // BLOCK)
        self.caches = [
            (normal(blocks, BLOCK, KV_HEADS, HEAD_DIM), normal(blocks, BLOCK, KV_HEADS, HEAD_DIM))
            for _ in self.layers
        ]
        order = torch.randperm(blocks, device="cuda", generator=generator).to(torch.int32)
        self.block_tables = order.view(batch, -1)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.positions = self.seq_lens.long() - 1
        last = self.block_tables[:, (context - 1) // BLOCK].long()
        self.slots = last * BLOCK + (context - 1) % BLOCK
        self.inv_freq = 1.0 / (150000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))
        self.hidden = normal(batch, HIDDEN)

    def run(self, pdl: bool) -> list[torch.Tensor]:
        x, residual, outs = self.hidden, None, []
        batch = x.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches, strict=True):
            normed, residual = fused_add_rms_norm(x, residual, layer["norm1"], 1e-5, pdl=pdl)
            qkv = linear(normed, layer["qkv"], layer["qkv_bias"], pdl=pdl)
            q, k, v = split_qkv(qkv, HEADS, KV_HEADS, HEAD_DIM)
            q = rope_and_cache_write(
                q, k, v, self.positions, self.inv_freq, 1.3, k_cache, v_cache, self.slots, pdl=pdl
            )  # fmt: skip
            attn = paged_attention_decode(
                q, k_cache, v_cache, self.block_tables, self.seq_lens, layer["sinks"],
                window=None, scale=HEAD_DIM**-0.5, pdl=pdl,
            )  # fmt: skip
            x = linear(attn.view(batch, -1), layer["o"], layer["o_bias"], pdl=pdl)
            normed, residual = fused_add_rms_norm(x, residual, layer["norm2"], 1e-5, pdl=pdl)
            x = mxfp4_moe(normed, layer["moe"], pdl=pdl)
            outs += [q, attn, x, residual]
        return outs


def _replayed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_pdl_chain_is_bit_identical(batch: int) -> None:
    chain = _Chain(batch, 700, fresh_seed())
    plain = [o.clone() for o in chain.run(pdl=False)]
    for outs in (chain.run(pdl=True), _replayed(lambda: chain.run(pdl=True))):
        torch.cuda.synchronize()
        for a, b in zip(plain, outs, strict=True):
            assert torch.equal(a, b)
            assert torch.isfinite(a.float()).all()
