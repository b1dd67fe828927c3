"""The KV manager: two groups, sliding-window freeing, prefix hits that need their window."""

from __future__ import annotations

from factories import make_request

from gptoss_serve.engine.kv_manager import (
    NO_BLOCK,
    SLIDING_GROUP,
    CachedPrefix,
    KvCacheManager,
    sliding_blocks_bound,
    sliding_pool_bound,
)


def _computed(kv: KvCacheManager, request_id: str, prompt: list[int]):
    """A request whose whole prompt is computed and registered, then finished and freed."""
    request = make_request(request_id, prompt)
    assert kv.allocate(request, len(prompt), kv.find_cached_prefix(request))
    request.num_computed_tokens = len(prompt)
    kv.register_computed_blocks(request)
    kv.free_outside_window(request)
    return request


def test_free_outside_window_marks_entries_and_returns_blocks() -> None:
    kv = KvCacheManager(16, 16, sliding_window=32)
    request = _computed(kv, "a", list(range(100, 160)))  # 60 tokens, 4 blocks
    # The next query (position 60) sees 29..60: block 0 is out.
    assert request.block_ids[SLIDING_GROUP][0] == NO_BLOCK
    assert NO_BLOCK not in request.block_ids[SLIDING_GROUP][1:]
    assert NO_BLOCK not in request.block_ids[0]
    assert kv.pools[SLIDING_GROUP].num_used_blocks == 3
    assert kv.free_outside_window(request) == 0  # idempotent
    kv.free(request)
    assert [p.num_free_blocks for p in kv.pools] == [16, 16]


def test_sliding_prefix_hit_needs_the_blocks_of_its_window() -> None:
    kv = KvCacheManager(16, 16, sliding_window=32)
    prompt = list(range(100, 160))
    kv.free(_computed(kv, "a", prompt))
    sliding = kv.pools[SLIDING_GROUP]
    # Sliding blocks 0..2 are full and registered, 3 (positions 48..59) is partial. Freed in
    # this order: 0 (it left the window), then 3 (uncached), 2, 1: LRU order 0, 2, 1.
    follow_up = make_request("b", [*prompt, 7])  # 61 tokens: a hit of at most 48
    hit = kv.find_cached_prefix(follow_up)
    assert hit.num_tokens == 48
    assert hit.block_ids[SLIDING_GROUP][0] == NO_BLOCK  # before the window of position 48
    # Taking the uncached blocks, then evicting block 0: a hit at 48 only needs 1 and 2 ...
    taken = sliding.allocate(sliding.num_free_blocks - 3 + 1)
    assert sliding.lookup(follow_up.block_hashes[0]) is None
    assert kv.find_cached_prefix(follow_up).num_tokens == 48
    # ... but without block 2 it falls back to 32 (window: blocks 0 and 1), then to 16
    # (window: block 0): both gone, so no hit although the full group still has all three.
    taken += sliding.allocate(1)
    assert sliding.lookup(follow_up.block_hashes[1]) is not None
    assert all(kv.pools[0].lookup(h) is not None for h in follow_up.block_hashes[:3])
    assert kv.find_cached_prefix(follow_up) == CachedPrefix(0, ((), ()))
    sliding.free(taken)


def test_a_hit_on_unreferenced_blocks_counts_them_against_the_free_blocks() -> None:
    kv = KvCacheManager(4, sliding_window=None)
    prompt = list(range(48))
    kv.free(_computed(kv, "a", prompt))  # 3 cached blocks, all free
    request = make_request("b", [*prompt, 1, 2])
    hit = kv.find_cached_prefix(request)
    assert hit.num_tokens == 48
    # 48 cached + 2 new tokens need one more block: 1 free uncached block is left, so 2 more
    # tokens fit but 17 do not (the 3 revived blocks are not free for the taking).
    assert not kv.allocate(request, 17 + 16, hit)
    assert request.block_ids == []
    assert kv.allocate(request, 2, hit)
    assert kv.pools[0].ref_counts == [1, 1, 1, 1]


def test_allocation_refused_changes_nothing() -> None:
    kv = KvCacheManager(3, 5, sliding_window=32)  # 100 tokens need 7 blocks in each group
    request = make_request("a", 100)
    assert not kv.allocate(request, 100, kv.find_cached_prefix(request))
    assert request.block_ids == [] and kv.num_refusals == [1, 1]
    assert [p.num_free_blocks for p in kv.pools] == [3, 5]


def test_sliding_bounds() -> None:
    # kernels/attention.py: a decode in a 128-token window touches at most 9 blocks.
    assert sliding_blocks_bound(128, 1) == 9
    assert sliding_blocks_bound(128, 2048) == 137
    assert sliding_blocks_bound(32, 1) == 3
    # Brute force over alignments: the bound is reached and never exceeded.
    for window in (16, 32, 100, 128):
        for n in (1, 5, 16, 17, 64):
            worst = 0
            for c in range(0, 200):
                first = max(0, c - window + 1) // 16
                worst = max(worst, -(-(c + n) // 16) - first)
            assert worst == sliding_blocks_bound(window, n), (window, n)
    assert sliding_pool_bound(128, 64, 2048) == 64 * 9 + (2048 + 15 * 64) // 16


def test_frozen_tables_are_rebuilt_only_when_the_manager_changes_them() -> None:
    """A step's output carries ``Request.frozen_block_ids``: one tuple object while the tables
    stand (the input batch then skips rewriting that row), a new one with the new contents
    after every change: a block added, a sliding block freed, everything freed."""
    kv = KvCacheManager(16, 16, sliding_window=32)
    request = make_request("a", 20)
    assert kv.allocate(request, 20)  # 2 blocks
    frozen = request.frozen_block_ids()
    assert frozen == tuple(tuple(t) for t in request.block_ids)
    request.num_computed_tokens = 20
    assert kv.allocate(request, 1)  # token 21 still in block 1
    assert request.frozen_block_ids() is frozen
    request.num_computed_tokens = 32
    assert kv.allocate(request, 1)  # token 33 opens block 2
    grown = request.frozen_block_ids()
    assert grown is not frozen and len(grown[0]) == 3 and grown[0][:2] == frozen[0]
    request.num_computed_tokens = 60
    assert kv.allocate(request, 1)
    before = request.frozen_block_ids()
    assert kv.free_outside_window(request) == 1  # block 0 leaves the window
    after = request.frozen_block_ids()
    assert after is not before and after[SLIDING_GROUP][0] == NO_BLOCK
    assert kv.free_outside_window(request) == 0
    assert request.frozen_block_ids() is after  # nothing freed: nothing changed
    kv.free(request)
    assert request.frozen_block_ids() == ()
