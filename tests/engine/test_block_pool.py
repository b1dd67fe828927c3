"""The block pool: reference counts, free-block order, registration and chained hashes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gptoss_serve
from gptoss_serve.engine.block_pool import (
    BLOCK_SIZE,
    BlockPool,
    extend_block_hashes,
    hash_block,
    root_hash,
)


def test_block_size_matches_the_attention_kernels() -> None:
    from gptoss_serve.kernels.attention import DEFAULT_BLOCK_SIZE  # noqa: PLC0415 (torch)

    assert BLOCK_SIZE == DEFAULT_BLOCK_SIZE


def test_reference_counts_and_double_free() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2] and pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.register(blocks[0], b"h0")
    pool.touch([blocks[0]])  # shared by a second sequence
    pool.free(blocks)
    assert pool.ref_counts == [1, 0, 0, 0]
    pool.free([blocks[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([blocks[0]])
    with pytest.raises(RuntimeError, match="5 blocks asked, 4 free"):
        pool.allocate(5)


def test_uncached_blocks_go_first_then_cached_ones_least_recently_freed() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for block in blocks[:3]:
        pool.register(block, bytes([block]))
    pool.free([2, 0, 3, 1])  # cached LRU order: 2, 0, 1; block 3 uncached
    assert pool.num_cached_blocks == 3 and pool.lookup(bytes([0])) == 0
    assert pool.allocate(1) == [3]
    assert pool.allocate(2) == [2, 0]  # evicted: no longer findable
    assert pool.lookup(bytes([2])) is None and pool.lookup(bytes([0])) is None
    assert pool.block_hash(2) is None and pool.lookup(bytes([1])) == 1
    pool.touch([1])  # a hit revives a free cached block
    assert pool.ref_counts[1] == 1 and pool.num_free_blocks == 0


def test_a_hash_registered_twice_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.register(first, b"same")
    pool.register(second, b"same")
    assert pool.lookup(b"same") == first and pool.block_hash(second) is None
    pool.free([second])
    assert pool.allocate(1) == [second]  # it went back as an uncached block


def test_hashes_chain_the_whole_prefix_and_the_salt() -> None:
    tokens = list(range(40))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens)
    assert len(hashes) == 2  # only full blocks
    assert hashes[1] == hash_block(hash_block(root_hash(), tokens[:16]), tokens[16:32])
    other: list[bytes] = []
    extend_block_hashes(other, [99, *tokens[1:]])  # same second block, other first block
    assert other[0] != hashes[0] and other[1] != hashes[1]
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, "lora-1")
    assert salted[0] != hashes[0]
    extend_block_hashes(hashes, [*tokens, *range(8)])  # 48 tokens: one more block
    assert len(hashes) == 3
    # Token ids past 16 bits hash apart (ids are packed as 64-bit integers).
    assert hash_block(b"", [65536] * 16) != hash_block(b"", [0] * 16)


def test_engine_scheduling_modules_do_not_import_torch() -> None:
    modules = ["request", "block_pool", "kv_manager", "kv_sizing", "scheduler"]
    src = str(Path(gptoss_serve.__file__).resolve().parents[1])  # this checkout's package
    code = (
        f"import sys; sys.path.insert(0, {src!r})\n"
        + "".join(f"import gptoss_serve.engine.{m}\n" for m in modules)
        + "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
