"""The ops one forward pass calls, as a table: the fast kernels or their torch references.

``KERNEL_OPS`` dispatch as the kernels' public functions do (Triton on CUDA for the dtypes it
takes, the reference otherwise). ``REFERENCE_OPS`` are the plain-torch references on any
device: the float32 verification mode runs the engine (scheduler, paged cache, batching,
metadata) on them so that it can be compared with transformers at 1e-3, while every Triton
kernel is checked against the same references by its own tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from gptoss_serve.kernels import attention, linear, moe, norm, rope, sampling


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable
    fused_add_rms_norm: Callable
    qkv_rope_and_cache_write: Callable
    attention_decode: Callable
    attention_prefill: Callable
    moe: Callable
    sample_tokens: Callable
    # References read lengths on the host (a sync), so they cannot be captured in a graph.
    is_graph_safe: bool


@functools.cache
def kernel_ops(*, pdl: bool) -> Ops:
    """The kernels; ``pdl``: the norms, GEMVs (q/k/v with RoPE), decode attention and the MoE's
    decode path as programmatic dependent launches (kernels/launch.py; bench/pdl_step.py: the 120b
    batch-1 step 2.76 -> 2.59 ms on the H200, batch 64 unchanged, batch 8 2% slower)."""

    def launched(op: Callable) -> Callable:
        return functools.partial(op, pdl=True) if pdl else op

    return Ops(
        name="kernels",
        linear=launched(linear.linear),
        fused_add_rms_norm=launched(norm.fused_add_rms_norm),
        qkv_rope_and_cache_write=launched(rope.qkv_rope_and_cache_write),
        attention_decode=launched(attention.paged_attention_decode),
        attention_prefill=attention.paged_attention_prefill,
        moe=launched(moe.mxfp4_moe),
        sample_tokens=sampling.sample_tokens,
        is_graph_safe=True,
    )


KERNEL_OPS = kernel_ops(pdl=False)

REFERENCE_OPS = Ops(
    name="reference",
    linear=linear.linear_reference,
    fused_add_rms_norm=norm.fused_add_rms_norm_reference,
    qkv_rope_and_cache_write=rope.qkv_rope_and_cache_write_reference,
    attention_decode=attention.paged_attention_decode_reference,
    attention_prefill=attention.paged_attention_prefill_reference,
    moe=moe.mxfp4_moe_reference,
    sample_tokens=sampling.sample_tokens_reference,
    is_graph_safe=False,
)

OPS = {ops.name: ops for ops in (KERNEL_OPS, REFERENCE_OPS)}
