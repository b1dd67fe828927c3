"""A pool of fixed-size KV blocks for one KV group, with reference counts and a prefix cache.

Pure Python (no torch). A block holds the K/V of ``BLOCK_SIZE`` consecutive tokens of one
sequence in every layer of its group; its id indexes dimension 0 of those layers' caches
(``[num_blocks, BLOCK_SIZE, kv_heads, head_dim]``, see kernels/attention.py).

Prefix caching: once all tokens of a block are computed, the block is registered under the
hash of its tokens chained with the hash of everything before it (``hash_block``), so another
sequence with the same prefix can point its block table at it instead of computing it again.
Only full, computed blocks are ever registered and nobody writes a registered block again,
so a shared block is never written while another sequence reads it.

Free blocks come in two kinds: never registered (taken first), and registered but no longer
referenced (kept for future hits, evicted least recently freed first).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)

# Tokens per block; must equal kernels.attention.DEFAULT_BLOCK_SIZE (a test checks it; this
# module cannot import that one, which imports torch).
BLOCK_SIZE = 16


def root_hash(cache_salt: str = "") -> bytes:
    """The parent hash of a sequence's first block; the salt keeps namespaces apart."""
    return hashlib.sha256(b"gptoss-serve/prefix\x00" + cache_salt.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent, tokens): collision-safe in practice, so a hit never needs a token check."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], cache_salt: str = ""
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``block_hashes`` lacks."""
    num_full_blocks = len(token_ids) // BLOCK_SIZE
    parent = block_hashes[-1] if block_hashes else root_hash(cache_salt)
    for index in range(len(block_hashes), num_full_blocks):
        start = index * BLOCK_SIZE
        parent = hash_block(parent, token_ids[start : start + BLOCK_SIZE])
        block_hashes.append(parent)


class BlockPool:
    """``num_blocks`` blocks of one KV group: allocation, reference counts, cached blocks."""

    def __init__(self, num_blocks: int, *, name: str = "kv") -> None:
        if num_blocks < 1:
            raise ValueError(f"{name} block pool: need at least one block, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached_block: dict[bytes, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Registered blocks nobody references, least recently freed first (eviction order).
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, cached-but-unreferenced ones included."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_block)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hash[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The registered block with this hash, referenced or free, or None."""
        return self._cached_block.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (reference count 1), evicting cached ones if needed."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"{self.name} block pool: {num_blocks} blocks asked, {self.num_free_blocks} free"
            )
        block_ids = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id = self._free_uncached.popleft()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                del self._cached_block[self._block_hash[block_id]]
                self._block_hash[block_id] = None
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on registered blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                # Only a registered block can be found by a lookup, so it is in _free_cached.
                del self._free_cached[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero become free (in the order given, so
        pass a sequence's blocks last first: its head, the most shareable part, stays longest)."""
        for block_id in block_ids:
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"{self.name} block pool: block {block_id} freed twice")
            self.ref_counts[block_id] = count
            if count == 0:
                if self._block_hash[block_id] is None:
                    self._free_uncached.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable. When the hash is already registered (a prefix
        computed twice), the first block stays the one found and this one stays private."""
        if self._block_hash[block_id] is not None or block_hash in self._cached_block:
            return
        self._block_hash[block_id] = block_hash
        self._cached_block[block_hash] = block_id
