"""The paged KV cache tensors: one K and one V tensor per layer, in its KV group's blocks.

The block ids come from the scheduler (kv_manager.py): each group has its own pool, so a
full-attention layer's caches have ``num_full_blocks`` blocks and a sliding-window layer's
``num_sliding_blocks``. Each group is one allocation [2, layers, blocks, 16, KV, D] and a layer
gets views of it, in the layout kernels/attention.py documents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gptoss_serve.config import ModelConfig
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.kv_manager import FULL_GROUP, SLIDING_GROUP

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvCacheTensors:
    key: tuple[torch.Tensor, ...]  # per layer [num_blocks of its group, BLOCK_SIZE, KV, D]
    value: tuple[torch.Tensor, ...]
    groups: tuple[int, ...]  # per layer: FULL_GROUP or SLIDING_GROUP

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))


def layer_groups(config: ModelConfig) -> tuple[int, ...]:
    return tuple(
        SLIDING_GROUP if config.is_sliding(i) else FULL_GROUP
        for i in range(config.num_hidden_layers)
    )


def allocate_kv_cache(
    config: ModelConfig,
    *,
    num_full_blocks: int,
    num_sliding_blocks: int,
    device: str | torch.device,
    dtype: torch.dtype,
) -> KvCacheTensors:
    """Zeroed caches (a stray read of an unwritten slot sees zeros, never NaN)."""
    groups = layer_groups(config)
    num_blocks = {FULL_GROUP: num_full_blocks, SLIDING_GROUP: num_sliding_blocks}
    storage = {}
    for group in set(groups):
        num_layers = groups.count(group)
        shape = (
            2,
            num_layers,
            num_blocks[group],
            BLOCK_SIZE,
            config.num_key_value_heads,
            config.head_dim,
        )
        storage[group] = torch.zeros(shape, dtype=dtype, device=device)
    keys, values, seen = [], [], dict.fromkeys(storage, 0)
    for group in groups:
        index = seen[group]
        seen[group] += 1
        keys.append(storage[group][0, index])
        values.append(storage[group][1, index])
    cache = KvCacheTensors(tuple(keys), tuple(values), groups)
    logger.info(
        "KV cache allocated: %d full and %d sliding blocks, %.2f GiB of %s",
        num_full_blocks,
        num_sliding_blocks,
        cache.num_bytes / (1 << 30),
        dtype,
    )
    return cache
