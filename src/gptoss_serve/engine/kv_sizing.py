"""How many KV blocks fit: pure arithmetic on the memory left after the weights.

Pure Python (no torch): the runner measures the device (total and free bytes, its own usage
after loading the weights and a profiling run) and this module turns those numbers into block
counts. Full-attention layers get all the room that the sliding-window layers do not need,
and the sliding layers get only what their window needs for ``max_num_seqs`` sequences
(``sliding_pool_bound``), plus optional spare blocks that keep freed windows around for the
prefix cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.kv_manager import cdiv, sliding_pool_bound

logger = logging.getLogger(__name__)

GIB = 1 << 30


class KvCacheSizeError(ValueError):
    """The memory left cannot hold a useful KV cache; the message gives the numbers."""


@dataclass(frozen=True)
class KvCacheSpec:
    """The shape of the KV cache of one model: K and V per layer, per token."""

    num_full_layers: int
    num_sliding_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    dtype_bytes: int = 2  # bf16

    @classmethod
    def from_model_config(cls, config: ModelConfig, dtype_bytes: int = 2) -> KvCacheSpec:
        num_sliding = sum(config.is_sliding(i) for i in range(config.num_hidden_layers))
        return cls(
            num_full_layers=config.num_hidden_layers - num_sliding,
            num_sliding_layers=num_sliding,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            sliding_window=config.sliding_window,
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_token_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def full_block_bytes(self) -> int:
        """One block id of the full group: BLOCK_SIZE tokens in every full-attention layer."""
        return self.num_full_layers * BLOCK_SIZE * self.layer_token_bytes

    @property
    def sliding_block_bytes(self) -> int:
        return self.num_sliding_layers * BLOCK_SIZE * self.layer_token_bytes


@dataclass(frozen=True)
class KvCachePlan:
    num_full_blocks: int
    num_sliding_blocks: int  # 0 when the model has no sliding layers
    spec: KvCacheSpec

    @property
    def num_bytes(self) -> int:
        return (
            self.num_full_blocks * self.spec.full_block_bytes
            + self.num_sliding_blocks * self.spec.sliding_block_bytes
        )

    @property
    def max_num_tokens(self) -> int:
        """Context tokens the full-attention layers hold, over all sequences together."""
        return self.num_full_blocks * BLOCK_SIZE


def kv_cache_bytes(
    *,
    total_bytes: int,
    free_bytes: int,
    used_bytes: int,
    gpu_memory_utilization: float | None = None,
    max_gpu_memory_bytes: int | None = None,
    reserve_bytes: int = 0,
) -> int:
    """Bytes the KV cache may take.

    ``free_bytes``: free device memory now (after the weights); ``used_bytes``: what this
    process holds now. The process may hold at most ``gpu_memory_utilization * total_bytes``
    or ``max_gpu_memory_bytes`` (the smaller if both are given; 0.9 of the device if neither),
    and ``reserve_bytes`` stay free for activations and CUDA graphs.
    """
    if gpu_memory_utilization is None and max_gpu_memory_bytes is None:
        gpu_memory_utilization = 0.9
    caps = []
    if gpu_memory_utilization is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        caps.append(int(gpu_memory_utilization * total_bytes))
    if max_gpu_memory_bytes is not None:
        caps.append(max_gpu_memory_bytes)
    cap = min(caps)
    available = min(free_bytes, cap - used_bytes) - reserve_bytes
    if available <= 0:
        raise KvCacheSizeError(
            f"no memory left for the KV cache: the process holds {used_bytes / GIB:.2f} GiB "
            f"of a {cap / GIB:.2f} GiB cap, {free_bytes / GIB:.2f} GiB are free and "
            f"{reserve_bytes / GIB:.2f} GiB are reserved"
        )
    return available


def sliding_blocks(
    spec: KvCacheSpec, max_num_seqs: int, max_num_batched_tokens: int, num_spare: int = 0
) -> int:
    """Sliding-window blocks the cache holds for ``max_num_seqs`` running sequences
    (``sliding_pool_bound``) plus ``num_spare``; 0 for a model without sliding layers."""
    if not spec.num_sliding_layers:
        return 0
    return num_spare + sliding_pool_bound(spec.sliding_window, max_num_seqs, max_num_batched_tokens)


def plan_kv_cache(
    spec: KvCacheSpec,
    num_bytes: int,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_spare_sliding_blocks: int = 0,
) -> KvCachePlan:
    """Split ``num_bytes`` into sliding blocks (what the windows of ``max_num_seqs`` running
    sequences need, plus spares) and full-attention blocks (all the rest)."""
    if spec.num_full_layers < 1:
        raise KvCacheSizeError("a model without full-attention layers is not supported")
    num_sliding = sliding_blocks(
        spec, max_num_seqs, max_num_batched_tokens, num_spare_sliding_blocks
    )
    sliding_bytes = num_sliding * spec.sliding_block_bytes
    num_full = (num_bytes - sliding_bytes) // spec.full_block_bytes
    if num_full < 1:
        raise KvCacheSizeError(
            f"{num_bytes / GIB:.2f} GiB for the KV cache: the sliding-window layers take "
            f"{sliding_bytes / GIB:.2f} GiB for {max_num_seqs} sequences, leaving no "
            f"full-attention block of {spec.full_block_bytes} bytes"
        )
    plan = KvCachePlan(num_full_blocks=num_full, num_sliding_blocks=num_sliding, spec=spec)
    logger.info(
        "KV cache: %d full blocks (%d tokens), %d sliding blocks, %.2f GiB",
        num_full, plan.max_num_tokens, num_sliding, plan.num_bytes / GIB,
    )  # fmt: skip
    return plan


def seqs_that_fit(
    spec: KvCacheSpec,
    num_bytes: int,
    *,
    tokens_per_seq: int,
    max_num_batched_tokens: int,
    num_spare_sliding_blocks: int = 0,
) -> int:
    """The most sequences that ``num_bytes`` of KV cache holds at once with ``tokens_per_seq``
    tokens of context each: their full-attention blocks plus the sliding pool that
    ``plan_kv_cache`` reserves for that many running sequences (0 if not even one fits)."""
    if tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be >= 1, got {tokens_per_seq}")

    def needed(num_seqs: int) -> int:
        sliding = sliding_blocks(spec, num_seqs, max_num_batched_tokens, num_spare_sliding_blocks)
        full = num_seqs * cdiv(tokens_per_seq, BLOCK_SIZE)
        return sliding * spec.sliding_block_bytes + full * spec.full_block_bytes

    low, high = 0, 1  # needed(low) fits; grow high until it does not
    while needed(high) <= num_bytes:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if needed(middle) <= num_bytes else (low, middle)
    return low
