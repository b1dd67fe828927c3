"""A per-sequence KV cache for the plain-torch model (the GPU engine has its own paged one).

Keys are stored after RoPE. Storage grows by doubling so appending one token is O(1)
amortised. Sliding-window layers keep only their last ``window`` keys (the attention
reference takes the first stored key's position), so long chats do not grow them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    window: int | None
    keys: torch.Tensor | None = None  # [capacity, KV, D]
    values: torch.Tensor | None = None
    start: int = 0  # absolute position of keys[0]
    size: int = 0  # valid rows

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add [T, KV, D] keys/values; return all keys/values a new query may need, and the
        position of the first one."""
        self._trim()
        if self.keys is None:
            capacity = max(16, k.shape[0])
            self.keys = k.new_empty((capacity, *k.shape[1:]))
            self.values = v.new_empty((capacity, *v.shape[1:]))
        needed = self.size + k.shape[0]
        if needed > self.keys.shape[0]:
            self._grow(needed)
        self.keys[self.size : needed] = k
        self.values[self.size : needed] = v
        self.size = needed
        return self.keys[: self.size], self.values[: self.size], self.start

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[0])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((capacity, *old.shape[1:]))
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def _trim(self) -> None:
        # Runs before an append, so the views handed out last time are no longer in use.
        # Queries from position `end` on only see keys with position > end - window.
        if self.window is None or self.size <= 2 * self.window:
            return
        drop = self.size - (self.window - 1)
        self.keys[: self.window - 1] = self.keys[drop : self.size].clone()
        self.values[: self.window - 1] = self.values[drop : self.size].clone()
        self.start += drop
        self.size = self.window - 1


@dataclass
class KVCache:
    layers: list[LayerCache]
    length: int = 0  # tokens processed so far == position of the next token

    @classmethod
    def empty(cls, windows: list[int | None]) -> KVCache:
        return cls(layers=[LayerCache(window=w) for w in windows])

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            if layer.keys is not None:
                total += 2 * layer.keys.numel() * layer.keys.element_size()
        return total
