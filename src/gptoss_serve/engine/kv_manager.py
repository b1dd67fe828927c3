"""The KV blocks of every request, in two groups: full-attention and sliding-window layers.

Pure Python (no torch). Each group has its own ``BlockPool`` (its layers' caches have that
many blocks) and each request one block table per group, indexed by logical block (token
position // BLOCK_SIZE). A full-attention table covers every computed token. A sliding table
has the same length, but the blocks that lie wholly before the window of the next query are
given back to the pool and their entries become -1: the attention kernels never read them
(kernels/attention.py), so a sliding layer holds at most ``cdiv(window - 1, 16) + 1`` blocks
per sequence between steps, whatever the context length.

Prefix caching across both groups: a cached prefix of P tokens (a whole number of blocks) is
usable only when the full group has all its blocks AND the sliding group has the blocks that
the first new query (position P) can see, those holding positions P - window + 1 .. P - 1;
older sliding entries of the new table are -1 from the start. So the longest full-group hit
is shortened block by block until its sliding window is also cached. Freed sliding blocks
stay registered until evicted, so windows at popular prefix ends usually survive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gptoss_serve.engine.block_pool import BLOCK_SIZE, BlockPool, extend_block_hashes
from gptoss_serve.engine.request import Request

logger = logging.getLogger(__name__)

FULL_GROUP = 0
SLIDING_GROUP = 1
NO_BLOCK = -1  # a sliding-table entry whose block was freed (before the window)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_blocks_bound(window: int, num_new_tokens: int) -> int:
    """The most sliding blocks one request holds while computing ``num_new_tokens`` tokens:
    they span its window before the first new token plus the new tokens, ``window - 1 +
    num_new_tokens`` positions, which touch at most ``cdiv(positions - 1, 16) + 1`` blocks."""
    return cdiv(window + num_new_tokens - 2, BLOCK_SIZE) + 1


def sliding_pool_bound(window: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Sliding blocks that ``max_num_seqs`` running requests can hold at once, whatever their
    lengths: request r, computing n_r >= 0 tokens in a step, holds at most
    ``cdiv(window + 14 + n_r, 16) <= cdiv(window + 14, 16) + cdiv(n_r, 16)`` blocks, and
    ``sum cdiv(n_r, 16) <= (sum n_r + 15 * seqs) // 16`` with ``sum n_r <= budget``."""
    per_request = cdiv(window + BLOCK_SIZE - 2, BLOCK_SIZE)
    spread = (max_num_batched_tokens + (BLOCK_SIZE - 1) * max_num_seqs) // BLOCK_SIZE
    return max_num_seqs * per_request + spread


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix-cache hit for a request about to be admitted (nothing is referenced yet)."""

    num_tokens: int  # a multiple of BLOCK_SIZE, less than the request's token count
    block_ids: tuple[tuple[int, ...], ...]  # per group; the sliding one may start with -1s


class KvCacheManager:
    """Allocates, frees and shares the blocks of requests in every KV group."""

    def __init__(
        self,
        num_full_blocks: int,
        num_sliding_blocks: int = 0,
        *,
        sliding_window: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pools = [BlockPool(num_full_blocks, name="full")]
        if sliding_window is not None:
            self.pools.append(BlockPool(num_sliding_blocks, name="sliding"))
        elif num_sliding_blocks:
            raise ValueError("sliding blocks given without a sliding_window")
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        # Allocations refused for lack of blocks, per group (what triggers preemption).
        self.num_refusals = [0] * len(self.pools)

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def has_sliding_group(self) -> bool:
        return self.sliding_window is not None

    @property
    def usage(self) -> float:
        """Fraction of full-attention blocks in use (these bound the context that fits)."""
        return self.pools[FULL_GROUP].usage

    def window_start_block(self, num_computed_tokens: int) -> int:
        """First logical sliding block that a query at position ``num_computed_tokens`` (or
        later) can see: blocks before it may be freed."""
        assert self.sliding_window is not None
        return max(0, num_computed_tokens - self.sliding_window + 1) // BLOCK_SIZE

    # -- prefix cache ----------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest cached prefix usable in every group, leaving at least one token to
        compute (the model must produce logits for the last one)."""
        empty = tuple(() for _ in self.pools)
        if not self.enable_prefix_caching:
            return CachedPrefix(0, empty)
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.cache_salt)
        max_blocks = (request.num_tokens - 1) // BLOCK_SIZE
        full_ids: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pools[FULL_GROUP].lookup(block_hash)
            if block_id is None:
                break
            full_ids.append(block_id)
        num_blocks = len(full_ids)
        if not self.has_sliding_group:
            return CachedPrefix(num_blocks * BLOCK_SIZE, (tuple(full_ids),))
        sliding_ids = self._find_sliding_window(request.block_hashes, num_blocks)
        num_blocks = len(sliding_ids)
        return CachedPrefix(
            num_blocks * BLOCK_SIZE, (tuple(full_ids[:num_blocks]), tuple(sliding_ids))
        )

    def _find_sliding_window(self, block_hashes: list[bytes], num_blocks: int) -> list[int]:
        """Shorten ``num_blocks`` until the sliding blocks before its end are all cached;
        return that prefix's sliding table (-1 before the window)."""
        pool = self.pools[SLIDING_GROUP]
        while num_blocks > 0:
            first = self.window_start_block(num_blocks * BLOCK_SIZE)
            window = [pool.lookup(h) for h in block_hashes[first:num_blocks]]
            missing = [i for i, block_id in enumerate(window) if block_id is None]
            if not missing:
                return [NO_BLOCK] * first + window  # type: ignore[list-item]
            # Any prefix whose window contains the last missing block fails too.
            num_blocks = first + missing[-1]
        return []

    # -- allocation ------------------------------------------------------------------------

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens in every group, after its
        computed ones (or after ``prefix``, for a request being admitted, whose tables must be
        empty). Returns False, changing nothing, when some pool has too few free blocks."""
        if prefix is None:
            if _holds(request.block_ids, request.num_computed_tokens + num_new_tokens):
                return True  # a decode inside its last block (15 steps in 16): nothing to do
            num_computed = request.num_computed_tokens
            tables = request.block_ids
        else:
            if request.block_ids:
                raise RuntimeError(f"{request.request_id}: admitted while holding blocks")
            num_computed = prefix.num_tokens
            tables = [list(ids) for ids in prefix.block_ids]
        num_needed = cdiv(num_computed + num_new_tokens, BLOCK_SIZE)
        if not tables:  # first allocation of a request without a prefix hit
            tables = [[] for _ in self.pools]
        all_prefix_ids = self._prefix_ids(prefix)
        is_refused = False
        for group, (pool, table) in enumerate(zip(self.pools, tables, strict=True)):
            # Hit blocks that nobody references sit in the free count but are not for taking.
            prefix_ids = all_prefix_ids[group]
            num_revived = sum(1 for b in prefix_ids if b != NO_BLOCK and pool.is_free(b))
            if num_needed - len(table) > pool.num_free_blocks - num_revived:
                self.num_refusals[group] += 1
                is_refused = True
        if is_refused:
            return False
        changed = tables is not request.block_ids
        for pool, table, prefix_ids in zip(self.pools, tables, all_prefix_ids, strict=True):
            pool.touch(b for b in prefix_ids if b != NO_BLOCK)
            if num_needed > len(table):
                table.extend(pool.allocate(num_needed - len(table)))
                changed = True
        request.block_ids = tables
        if changed:
            request.tables_version += 1
        if prefix is not None:
            request.num_registered_blocks = len(prefix.block_ids[FULL_GROUP])
        return True

    def _prefix_ids(self, prefix: CachedPrefix | None) -> tuple[tuple[int, ...], ...]:
        return prefix.block_ids if prefix is not None else tuple(() for _ in self.pools)

    def free(self, request: Request) -> None:
        """Give back every block of the request, last first (the shareable head stays longest
        in the cache)."""
        if not request.block_ids:  # waiting: holds nothing
            return
        for pool, table in zip(self.pools, request.block_ids, strict=True):
            pool.free(b for b in reversed(table) if b != NO_BLOCK)
        request.block_ids = []
        request.tables_version += 1
        request.num_registered_blocks = 0

    def free_outside_window(self, request: Request) -> int:
        """Free the sliding blocks no query from ``num_computed_tokens`` on can see; their
        entries become -1. Returns how many were freed."""
        if not self.has_sliding_group or not request.block_ids:
            return 0
        table = request.block_ids[SLIDING_GROUP]
        stop = min(self.window_start_block(request.num_computed_tokens), len(table))
        if stop == 0 or table[stop - 1] == NO_BLOCK:  # nothing new left the window
            return 0
        start = stop
        while start > 0 and table[start - 1] != NO_BLOCK:  # -1 entries form a leading run
            start -= 1
        freed = table[start:stop]
        if freed:
            table[start:stop] = [NO_BLOCK] * len(freed)
            self.pools[SLIDING_GROUP].free(freed)
            request.tables_version += 1
        return len(freed)

    def register_computed_blocks(self, request: Request) -> None:
        """Make the request's newly completed blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // BLOCK_SIZE
        if num_full <= request.num_registered_blocks:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.cache_salt)
        for pool, table in zip(self.pools, request.block_ids, strict=True):
            for index in range(request.num_registered_blocks, num_full):
                if table[index] != NO_BLOCK:
                    pool.register(table[index], request.block_hashes[index])
        request.num_registered_blocks = num_full


def _holds(tables: list[list[int]], num_tokens: int) -> bool:
    """Whether every table already has the blocks of ``num_tokens`` tokens (none: False)."""
    if not tables:
        return False
    num_needed = cdiv(num_tokens, BLOCK_SIZE)
    return all(num_needed <= len(table) for table in tables)
