"""Paged sink attention: references against the dense ``sink_attention``, kernels against the
references, through the one comparator.

Three tiers. CPU (always): the paged references, in float32, equal ``sink_attention`` on
contiguous tensors. Interpreter (triton importable and TRITON_INTERPRET=1; on a CUDA machine
without it they run on the GPU): both Triton kernels on small ragged shapes. GPU
(@pytest.mark.gpu): gpt-oss shapes. Every cache slot that holds no key a query may see is NaN
(also inside live blocks), blocks wholly before the window are freed (-1 in the table, NaN in
the cache), table entries past a sequence name a NaN block, and outputs are NaN-poisoned: any
stray read or missed write fails.

bf16 tolerance (max_rel 1e-2, rms_rel 3e-3). The reference computes in float32 from the same
bf16 inputs and rounds the output once; the kernels also round P to bf16 before the PV product
(as every flash kernel does; relative error up to 2^-8 per weight) and sum in another order.
Measured by emulating those roundings in torch at gpt-oss shapes (64 heads, 5 draws each):
rms_rel 0.6-1.3e-3 at 1 key, 2.2-2.4e-3 at 127, 2.5-2.6e-3 from 1000 to 33000 keys (batch 32
too); max_rel <= 7.3e-3, i.e. one bf16 ulp of the largest output. The interpreter tests
measure 1.1-1.9e-3 and <= 5.1e-3. Run with ``--log-cli-level=INFO`` to see the errors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass

import pytest
import torch
from compare import assert_close, poisoned

from gptoss_serve.kernels import attention, kv_dtype
from gptoss_serve.kernels.attention import (
    DEFAULT_BLOCK_SIZE,
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_reference,
    sink_attention,
)
from gptoss_serve.kernels.kv_dtype import FP8, to_cache

log = logging.getLogger(__name__)

try:
    import triton  # noqa: F401  (only to know whether the kernels can run)

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BF16_TOLERANCE = dict(max_rel=1e-2, rms_rel=3e-3)
FP32_TOLERANCE = dict(max_rel=1e-5, rms_rel=1e-6)  # same math, other key subsets and order


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """Fresh random data every run; the seed is in the captured log of a failure."""
    seed = torch.seed()
    log.info("seed %d", seed)
    return seed


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    keys: list[torch.Tensor]  # per sequence, contiguous [L, KV, D]
    values: list[torch.Tensor]


def make_paged(
    seq_lens: list[int],
    first_needed: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
) -> Paged:
    """Random K/V for ragged sequences, scattered over shuffled physical blocks.

    first_needed[s]: the first position any query of sequence s may see; blocks wholly
    before it are freed as the engine does on sliding layers. ``cache_dtype`` (default
    ``dtype``): FP8 holds the keys and values rounded (kv_dtype.to_cache).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1  # + one block that is never written
    physical = torch.randperm(num_blocks, device=device).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    k_cache, v_cache = poisoned(shape, cache_dtype, device), poisoned(shape, cache_dtype, device)
    tables = torch.full(
        (len(seq_lens), max(blocks_per_seq) + 2),
        int(physical[-1]),
        dtype=torch.int32,
        device=device,
    )
    keys, values, used = [], [], 0
    for seq, num_tokens in enumerate(seq_lens):
        tables[seq, : blocks_per_seq[seq]] = physical[used : used + blocks_per_seq[seq]]
        used += blocks_per_seq[seq]
        freed = first_needed[seq] // block_size  # blocks [0, freed) hold no visible key
        tables[seq, :freed] = -1
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
        keys.append(k)
        values.append(v)
        # Keys no query may see stay NaN even inside live blocks: the kernels must not read them.
        live = torch.arange(first_needed[seq], num_tokens, device=device)
        slots = (tables[seq, live // block_size].long(), live % block_size)
        k_cache[slots] = to_cache(k[live], cache_dtype)
        v_cache[slots] = to_cache(v[live], cache_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Paged(k_cache, v_cache, tables, lens, keys, values)


def first_needed(seq_lens: list[int], num_new: list[int], window: int | None) -> list[int]:
    if window is None:
        return [0] * len(seq_lens)
    return [max(0, n - new - window + 1) for n, new in zip(seq_lens, num_new, strict=True)]


def start_loc(num_new: list[int], device: str) -> torch.Tensor:
    """query_start_loc [S + 1] int32 from per-sequence new-token counts."""
    return torch.tensor([0, *num_new], device=device).cumsum(0).to(torch.int32)


def random_inputs(num_tokens: int, num_heads: int, head_dim: int, dtype, device: str):
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    return q, torch.randn(num_heads, device=device).to(dtype)


# --- CPU: the paged references are the dense reference ------------------------------------

TINY = dict(num_kv_heads=2, head_dim=16)
TINY_HEADS = 8


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 8, 16])
def test_references_match_dense(window: int | None, block_size: int) -> None:
    lens, new = [1, 5, 37, 16, 40], [1, 3, 37, 4, 1]
    paged = make_paged(
        lens,
        first_needed(lens, new, window),
        block_size=block_size,
        dtype=torch.float32,
        device="cpu",
        **TINY,
    )
    q, sinks = random_inputs(sum(new), TINY_HEADS, 16, torch.float32, "cpu")
    args = (paged.k_cache, paged.v_cache, paged.block_tables)
    prefill = paged_attention_prefill_reference(
        q, *args, start_loc(new, "cpu"), paged.seq_lens, sinks, window=window, scale=0.25
    )
    rows = start_loc(new, "cpu").tolist()
    for seq, num_tokens in enumerate(lens):
        dense = sink_attention(
            q[rows[seq] : rows[seq + 1]],
            paged.keys[seq],
            paged.values[seq],
            sinks,
            query_start=num_tokens - new[seq],
            window=window,
            scale=0.25,
        )
        assert_close(prefill[rows[seq] : rows[seq + 1]], dense, **FP32_TOLERANCE)

    q_decode = q[torch.tensor(rows[1:]) - 1]  # the last query of each sequence
    decode = paged_attention_decode_reference(
        q_decode, *args, paged.seq_lens, sinks, window=window, scale=0.25
    )
    for seq, num_tokens in enumerate(lens):
        dense = sink_attention(
            q_decode[seq : seq + 1],
            paged.keys[seq],
            paged.values[seq],
            sinks,
            query_start=num_tokens - 1,
            window=window,
            scale=0.25,
        )
        assert_close(decode[seq : seq + 1], dense, **FP32_TOLERANCE)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("query_start", "key_start"), [(0, 0), (37, 0), (37, 30)])
def test_reference_in_query_chunks_equals_all_at_once(
    monkeypatch: pytest.MonkeyPatch, window: int | None, query_start: int, key_start: int
) -> None:
    """A long prompt's reference attention goes in chunks of queries (bounded memory: a 14k
    prompt on the demo model was killed); each chunk sees only its visible keys, and every
    query's softmax is its own, so the chunks give what one call gives."""
    num_tokens, num_heads, num_kv_heads, head_dim = 29, 4, 2, 16
    num_keys = query_start + num_tokens - key_start
    q = torch.randn(num_tokens, num_heads, head_dim)
    k, v = torch.randn(2, num_keys, num_kv_heads, head_dim)
    sinks = torch.randn(num_heads)
    args = dict(query_start=query_start, key_start=key_start, window=window, scale=0.25)
    whole = sink_attention(q, k, v, sinks, **args)
    calls = []
    dense = attention._dense_sink_attention
    monkeypatch.setattr(attention, "_dense_sink_attention",
                        lambda q, k, *a, **kw: calls.append(q.shape[0] * k.shape[0]) or
                        dense(q, k, *a, **kw))  # fmt: skip
    monkeypatch.setattr(attention, "REFERENCE_LOGITS", num_heads * num_keys * 4)  # 4 queries
    chunked = sink_attention(q, k, v, sinks, **args)
    assert len(calls) == 8 and max(calls) <= 4 * num_keys
    if window is not None:  # a chunk reads only the keys its window reaches
        assert max(calls) <= 4 * (4 + window - 1)
    assert_close(chunked, whole, max_rel=1e-5, rms_rel=1e-6)


@pytest.mark.parametrize("window", [None, 8])
def test_decode_reference_is_last_prefill_row(window: int | None) -> None:
    lens, new = [1, 6, 37, 33], [1, 6, 20, 2]
    paged = make_paged(
        lens,
        first_needed(lens, new, window),
        block_size=4,
        dtype=torch.float32,
        device="cpu",
        **TINY,
    )
    q, sinks = random_inputs(sum(new), TINY_HEADS, 16, torch.float32, "cpu")
    args = (paged.k_cache, paged.v_cache, paged.block_tables)
    loc = start_loc(new, "cpu")
    prefill = paged_attention_prefill_reference(
        q, *args, loc, paged.seq_lens, sinks, window=window, scale=0.25
    )
    last = loc[1:].long() - 1
    decode = paged_attention_decode_reference(
        q[last], *args, paged.seq_lens, sinks, window=window, scale=0.25
    )
    assert_close(decode, prefill[last], **FP32_TOLERANCE)


# --- Triton kernels on small ragged shapes ------------------------------------------------


@pytest.fixture()
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """'cpu' under the interpreter (with its shims), 'cuda' on a GPU machine, else skip."""
    if HAS_TRITON and INTERPRET:
        _shim_interpreter(monkeypatch)
        return "cpu"
    if HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    pytest.skip("needs triton with TRITON_INTERPRET=1, or CUDA")


def _shim_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three gaps of triton 3.6's interpreter, none of them in compiled code: it calls int()
    on a one-element array (a TypeError since numpy 2.4, triton-lang/triton#9171), it
    multiplies bf16 dot operands as their uint16 bit patterns (triton-lang/triton#11584), and
    it truncates float32 -> bf16 where the GPU rounds to nearest even (which doubles the
    error). Widening bf16 to float32 is exact, as the tensor cores' products are."""
    import numpy as np  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415

    patch_tensor = interpreter._patch_lang_tensor
    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def patch_lang_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def widen(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def dot(self, a, b, *args):
        return create_dot(self, widen(a), widen(b), *args)

    def cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
    monkeypatch.setattr(builder, "create_dot", dot)
    monkeypatch.setattr(builder, "cast_impl", cast)


SMALL = dict(num_kv_heads=2)
SMALL_SHAPES = [(4, 16), (16, 32)]  # (block_size, head_dim)


@pytest.mark.parametrize("max_seq_len", [None, 16])  # many splits / a single split
@pytest.mark.parametrize("window", [None, 8, 24])  # 24: a window wide enough to split
@pytest.mark.parametrize(("block_size", "head_dim"), SMALL_SHAPES)
def test_decode_kernel(kernel_device, block_size, head_dim, window, max_seq_len) -> None:
    _check_decode_kernel(kernel_device, block_size, head_dim, window, max_seq_len)


@pytest.mark.parametrize(("window", "max_seq_len"), [(None, None), (24, 16)])
def test_decode_kernel_fp8_cache(kernel_device, window, max_seq_len) -> None:
    """An FP8 cache is read as the bf16 values it holds (the reference reads them so too)."""
    _check_decode_kernel(kernel_device, 16, 32, window, max_seq_len, cache_dtype=FP8)


def _check_decode_kernel(
    kernel_device, block_size, head_dim, window, max_seq_len, *, cache_dtype=None
) -> None:
    lens = [1, 5, 37, 0, 16]  # 0: a CUDA-graph padding slot, whose output must be zeros
    paged = make_paged(
        lens,
        first_needed(lens, [1] * len(lens), window),
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=kernel_device,
        cache_dtype=cache_dtype,
        **SMALL,
    )
    q, sinks = random_inputs(len(lens), TINY_HEADS, head_dim, torch.bfloat16, kernel_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, sinks)
    options = dict(window=window, scale=head_dim**-0.5, max_seq_len=max_seq_len)
    out = paged_attention_decode(*args, **options, out=poisoned(q.shape, q.dtype, kernel_device))
    expected = paged_attention_decode_reference(*args, **options)
    assert (out[3] == 0).all()
    log.info("decode %s", assert_close(out, expected, **BF16_TOLERANCE))


@pytest.mark.parametrize("chunked", [False, True])  # a fresh prompt / new tokens on a cache
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize(("block_size", "head_dim"), SMALL_SHAPES)
def test_prefill_kernel(kernel_device, block_size, head_dim, window, chunked) -> None:
    _check_prefill_kernel(kernel_device, block_size, head_dim, window, chunked)


@pytest.mark.parametrize("window", [None, 8])
def test_prefill_kernel_fp8_cache(kernel_device, window) -> None:
    _check_prefill_kernel(kernel_device, 16, 32, window, chunked=True, cache_dtype=FP8)


def _check_prefill_kernel(
    kernel_device, block_size, head_dim, window, chunked, *, cache_dtype=None
) -> None:
    lens = [1, 5, 37, 16, 20]
    new = [1, 2, 19, 16, 1] if chunked else lens
    paged = make_paged(
        lens,
        first_needed(lens, new, window),
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=kernel_device,
        cache_dtype=cache_dtype,
        **SMALL,
    )
    q, sinks = random_inputs(sum(new), TINY_HEADS, head_dim, torch.bfloat16, kernel_device)
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        start_loc(new, kernel_device),
        paged.seq_lens,
        sinks,
    )
    options = dict(window=window, scale=head_dim**-0.5)
    out = paged_attention_prefill(*args, **options, out=poisoned(q.shape, q.dtype, kernel_device))
    expected = paged_attention_prefill_reference(*args, **options)
    log.info("prefill %s", assert_close(out, expected, **BF16_TOLERANCE))
    if cache_dtype == FP8:  # full layers read bf16 copies of the blocks: the same values
        _check_upcast_is_the_direct_read(args, options, out)


def _check_upcast_is_the_direct_read(args: tuple, options: dict, out: torch.Tensor) -> None:
    """The prefill op's output over an FP8 cache equals the kernel's reading the FP8 cache
    itself, bit for bit, whether the op copied the blocks to bf16 (full layers) or not."""
    from gptoss_serve.kernels._attention_prefill import launch_prefill  # noqa: PLC0415

    direct = launch_prefill(*args, torch.empty_like(out), **options)
    assert torch.equal(direct, out)


def test_decode_tiles_over_fp8_take_6_stages_up_to_16_sequences() -> None:
    decode = pytest.importorskip("gptoss_serve.kernels._attention_decode")
    for batch in (1, 16):
        assert decode.gpu_tiles_for(batch, fp8_cache=True) == dataclasses.replace(
            decode.gpu_tiles_for(batch), num_stages=decode.FP8_STAGES_UP_TO_16
        )
    for batch in (17, 64):
        assert decode.gpu_tiles_for(batch, fp8_cache=True) == decode.gpu_tiles_for(batch)


def test_upcast_blocks_copies_the_named_blocks_as_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = to_cache(torch.randn(7, 4, 2, 16), FP8)
    values = to_cache(torch.randn(7, 4, 2, 16), FP8)
    tables = torch.tensor([[3, 0, -1], [6, 6, 2]], dtype=torch.int32)
    keys, vals, table = kv_dtype.upcast_blocks(cache, values, tables)
    assert keys.dtype == vals.dtype == torch.bfloat16 and table.tolist() == [[0, 1, 2], [3, 4, 5]]
    for row, blocks in enumerate(tables.tolist()):
        for column, block in enumerate(blocks):
            if block >= 0:  # -1: some block no query reads
                copy = table[row, column]
                assert torch.equal(keys[copy], cache[block].to(torch.bfloat16))
                assert torch.equal(vals[copy], values[block].to(torch.bfloat16))
    monkeypatch.setattr(kv_dtype, "UPCAST_MAX_BYTES", keys.numel() * 4 - 1)
    assert kv_dtype.upcast_blocks(cache, values, tables) is None


@pytest.mark.parametrize("window", [None, 8])
def test_decode_kernel_is_last_prefill_row(kernel_device, window) -> None:
    lens, new = [3, 37, 18], [3, 9, 1]
    paged = make_paged(
        lens,
        first_needed(lens, new, window),
        head_dim=32,
        block_size=4,
        dtype=torch.bfloat16,
        device=kernel_device,
        **SMALL,
    )
    q, sinks = random_inputs(sum(new), TINY_HEADS, 32, torch.bfloat16, kernel_device)
    cache = (paged.k_cache, paged.v_cache, paged.block_tables)
    loc = start_loc(new, kernel_device)
    options = dict(window=window, scale=32**-0.5)
    prefill = paged_attention_prefill(q, *cache, loc, paged.seq_lens, sinks, **options)
    last = loc[1:].long() - 1
    decode = paged_attention_decode(q[last], *cache, paged.seq_lens, sinks, **options)
    assert_close(decode, prefill[last], **BF16_TOLERANCE)


# --- GPU: gpt-oss shapes ------------------------------------------------------------------

REAL = dict(num_kv_heads=8, head_dim=64, block_size=DEFAULT_BLOCK_SIZE)
REAL_HEADS, REAL_SCALE = 64, 0.125


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("batch", [1, 24, 32, 48, 64, 96, 112])  # one per row of GPU_TILES
@pytest.mark.parametrize("context", [1, 127, 128, 129, 1000, 8191, 33000])
def test_decode_gpu(context: int, batch: int, window: int | None) -> None:
    _check_decode_gpu(context, batch, window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize(("context", "batch"), [(1, 1), (1000, 64), (33000, 1), (8191, 32)])
def test_decode_gpu_fp8_cache(context: int, batch: int, window: int | None) -> None:
    _check_decode_gpu(context, batch, window, cache_dtype=FP8)


def _check_decode_gpu(context, batch, window, cache_dtype=None) -> None:
    # The longest sequence has the named context; the others are ragged below it.
    lens = [context, *torch.randint(1, context + 1, (batch - 1,)).tolist()]
    paged = make_paged(
        lens, first_needed(lens, [1] * batch, window), dtype=torch.bfloat16, device="cuda",
        cache_dtype=cache_dtype, **REAL,
    )  # fmt: skip
    q, sinks = random_inputs(batch, REAL_HEADS, 64, torch.bfloat16, "cuda")
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, sinks)
    out = paged_attention_decode(
        *args, window=window, scale=REAL_SCALE, out=poisoned(q.shape, q.dtype, "cuda")
    )
    expected = paged_attention_decode_reference(*args, window=window, scale=REAL_SCALE)
    log.info("decode %s", assert_close(out, expected, **BF16_TOLERANCE))


def _check_prefill_gpu(lens: list[int], new: list[int], window: int | None,
                       cache_dtype: torch.dtype | None = None) -> None:  # fmt: skip
    paged = make_paged(
        lens, first_needed(lens, new, window), dtype=torch.bfloat16, device="cuda",
        cache_dtype=cache_dtype, **REAL,
    )  # fmt: skip
    q, sinks = random_inputs(sum(new), REAL_HEADS, 64, torch.bfloat16, "cuda")
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        start_loc(new, "cuda"),
        paged.seq_lens,
        sinks,
    )
    out = paged_attention_prefill(
        *args, window=window, scale=REAL_SCALE, out=poisoned(q.shape, q.dtype, "cuda")
    )
    expected = paged_attention_prefill_reference(*args, window=window, scale=REAL_SCALE)
    log.info("prefill %s", assert_close(out, expected, **BF16_TOLERANCE))
    if cache_dtype == FP8:
        _check_upcast_is_the_direct_read(args, dict(window=window, scale=REAL_SCALE), out)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("cached", [0, 1000])
@pytest.mark.parametrize("num_new", [1, 17, 512, 2048])
def test_prefill_gpu(num_new: int, cached: int, window: int | None) -> None:
    _check_prefill_gpu([cached + num_new], [num_new], window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_prefill_gpu_ragged(window: int | None) -> None:
    # Fresh prompts, chunks on top of caches, and a decode-like single token, in one batch.
    _check_prefill_gpu([1, 1017, 549, 5100, 300], [1, 17, 512, 100, 300], window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_prefill_gpu_ragged_fp8_cache(window: int | None) -> None:
    _check_prefill_gpu([1, 1017, 549, 5100, 300], [1, 17, 512, 100, 300], window, FP8)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the GPU")
def test_small_batch_decode_reads_its_uploads_before_the_pdl_wait() -> None:
    """The q/k/v kernel (sm_90 build) lets the decode attention launch at its start, and the
    attention of up to 16 sequences reads the lengths and block tables and asks L2 for its
    first K/V tile before its wait; q is read after it (bench/RESULTS.md v17)."""
    from moe_cases import compile_sm90  # noqa: PLC0415

    from gptoss_serve.kernels import _attention_decode, _qkv_rope  # noqa: PLC0415

    tiles = _attention_decode.gpu_tiles_for(1)
    assert tiles.prefetch and not _attention_decode.gpu_tiles_for(17).prefetch
    bf16 = ("q_ptr", "k_ptr", "v_ptr", "sinks_ptr", "out_ptr")
    pointers = {name: "*bf16" for name in bf16} | {"seq_lens_ptr": "*i32", "table_ptr": "*i32"}
    pointers |= {name: "*fp32" for name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr")}
    constexprs = dict(NUM_HEADS=64, GROUP=8, BLOCK_G=16, HEAD_DIM=64, PAGE_SIZE=16,
                      BLOCK_N=tiles.block_n, SPLIT_MIN=tiles.split_min, HAS_WINDOW=False,
                      FOLD_SINK=False, PDL=True, PREFETCH=True)  # fmt: skip
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    ptx = compile_sm90(_attention_decode._decode_kernel, constexprs, pointers, options)
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert "prefetch.global.L2" in before and "prefetch.global.L2" not in after
    assert "ld.global" in before  # the length and the first tile's block-table entries
    assert ".local" not in ptx

    qkv = dict(A=64, KV=8, HALF=32, K=2880, K_PAD=4096, T_PAD=1, BP=2, PDL=True,
               INTERPRET=False)  # fmt: skip
    pointers = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16",
                "cos_sin_ptr": "*fp32", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16", "positions_ptr": "*i32",
                "slot_mapping_ptr": "*i32"}  # fmt: skip
    ptx = compile_sm90(_qkv_rope._qkv_rope_kernel, qkv, pointers, dict(num_warps=8))
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")
