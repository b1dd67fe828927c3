"""Causal grouped-query attention with learned sinks and an optional sliding window.

gpt-oss specifics: each query head has one learned "sink" logit that joins the softmax and is
dropped after normalising (so a head may attend to nothing); even layers only see keys with
q_pos − k_pos < window (128).

``sink_attention`` is the dense reference the model uses. The paged ops below are the engine's
kernels (Triton, in ``_attention_decode.py`` / ``_attention_prefill.py``), with plain-torch
references of the same signatures at the bottom.

The paged KV cache (the contract with the engine), per layer:

- ``k_cache``, ``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim] bf16 (or FP8
  E4M3, read as bf16: kernels/kv_dtype.py; float32 in the verification mode). block_size
  is a power of two, default ``DEFAULT_BLOCK_SIZE`` = 16: the kernels gather keys one row at a
  time through the block table, so their tiles (64 keys) do not depend on it, and 16 keeps the
  waste of half-filled blocks, prefix-sharing granularity and a sliding layer's footprint (at
  most 9 blocks for window 128) small. One key row of one KV head is 128 contiguous bytes.
- ``block_tables``: [num_seqs, max_blocks_per_seq] int32, physical block of each logical one.
  Entries past a sequence's length are arbitrary. On sliding-window layers, entries of blocks
  that lie entirely before the first key any of this step's queries can see (position
  ``first_query_pos − window + 1``) may be -1 (freed): the kernels never read them.
- ``seq_lens``: [num_seqs] int32, tokens in the cache for each sequence INCLUDING this step's
  new ones, whose K/V are already written. A decode query sits at ``seq_lens[b] − 1``; the
  n_s prefill queries of sequence s at ``seq_lens[s] − n_s .. seq_lens[s] − 1``. A decode slot
  with ``seq_lens[b] == 0`` (CUDA-graph padding) yields zeros.
- ``query_start_loc`` (prefill): [num_seqs + 1] int32, cumulative new-token counts.

Decode splits (flash-decoding) without a host sync: the number of splits is a host function
of the batch size and an upper bound on the context (``max_seq_len`` if the caller passes it,
else ``block_tables.shape[1] · block_size``), chosen so that a few programs per SM exist
(``_attention_decode.choose_num_splits``); each sequence then divides its own visible keys
evenly among those splits inside the kernel, at least 128 keys per split. A CUDA graph
captured once is therefore correct for every length; a bound that is too large only leaves
some programs idle. With one split (large batches) no second, combining kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptoss_serve.kernels.kv_dtype import FP8, check_cache, upcast_blocks
from gptoss_serve.kernels.launch import pdl_applies

DEFAULT_BLOCK_SIZE = 16


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    query_start: int,
    window: int | None,
    scale: float,
    key_start: int = 0,
) -> torch.Tensor:
    """Plain-torch reference.

    q [T, A, D] at positions query_start..query_start+T-1; k, v [S, KV, D] at positions
    key_start..key_start+S-1; sinks [A]. Returns [T, A, D] in q's dtype. Logits, softmax and
    the weighted sum are computed in float32.

    The logits of all T queries at once are [A, T, S] float32, several copies deep: a 14k-token
    prompt on the 8-head demo model needed ~30 GB and was killed. So the queries go in chunks
    of at most ``REFERENCE_LOGITS`` logits, each against only the keys it can see (each
    query's softmax is its own: the same result).
    """
    num_tokens, num_heads, _ = q.shape
    chunk = max(1, REFERENCE_LOGITS // max(1, num_heads * k.shape[0]))
    if num_tokens <= chunk:
        return _dense_sink_attention(q, k, v, sinks, query_start=query_start, key_start=key_start,
                                     window=window, scale=scale)  # fmt: skip
    outs = []
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        # Keys from the chunk's first visible one (window) to its last query's position.
        first = 0 if window is None else max(0, query_start + start - window + 1 - key_start)
        last = min(k.shape[0], query_start + stop - key_start)
        outs.append(_dense_sink_attention(
            q[start:stop], k[first:last], v[first:last], sinks, query_start=query_start + start,
            key_start=key_start + first, window=window, scale=scale,
        ))  # fmt: skip
    return torch.cat(outs)


# Most logits one dense reference call holds (float32, a few copies): 2^24 is 64 MB each.
REFERENCE_LOGITS = 1 << 24


def _dense_sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *, query_start: int,
    key_start: int, window: int | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """``sink_attention`` of all of q at once."""
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Heads are grouped as in HF's repeat_kv: query head h reads KV head h // group.
    q32 = q.float().view(num_tokens, num_kv_heads, group, head_dim)
    logits = torch.einsum("tkgd,skd->kgts", q32, k.float()) * scale  # [KV, G, T, S]

    q_pos = torch.arange(num_tokens, device=q.device)[:, None] + query_start
    k_pos = torch.arange(num_keys, device=q.device)[None, :] + key_start
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    logits = logits.masked_fill(~visible, float("-inf"))

    sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_tokens, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # drop the sink after normalising
    out = torch.einsum("kgts,skd->tkgd", probs, v.float())
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)


def paged_attention_decode(  # noqa: PLR0917  (the engine calls it positionally)
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One new token per sequence: q [B, A, D] at positions seq_lens − 1 -> [B, A, D].

    ``max_seq_len`` (host int, optional) only sizes the split count; ``out`` (optional,
    [B, A, D]) receives the result, e.g. a CUDA graph's static buffer; ``pdl``: launch as
    programmatic dependent launches where that applies (kernels/launch.py).
    """
    # Imported here: triton is a GPU-only dependency, and the model imports this module.
    from gptoss_serve.kernels._attention_decode import launch_decode  # noqa: PLC0415

    _check_paged(q, k_cache, v_cache, block_tables=block_tables, seq_lens=seq_lens, sinks=sinks)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError("decode: one block-table row and one length per query row")
    out = _output(q, out)
    return launch_decode(
        q, k_cache, v_cache, block_tables, seq_lens, sinks, out,
        window=window, scale=scale, max_seq_len=max_seq_len, pdl=pdl_applies(pdl, q),
    )  # fmt: skip


def paged_attention_prefill(  # noqa: PLR0917  (the engine calls it positionally)
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal prefill over the paged cache: q [T, A, D] -> [T, A, D].

    Sequence s owns rows query_start_loc[s]:query_start_loc[s+1] of q, at the last positions
    of its seq_lens[s] tokens (so chunked prefill and prefix reuse are the same call).
    """
    from gptoss_serve.kernels._attention_prefill import launch_prefill  # noqa: PLC0415

    _check_paged(q, k_cache, v_cache, block_tables=block_tables, seq_lens=seq_lens, sinks=sinks)
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must be int32 [num_seqs + 1]")
    out = _output(q, out)
    if k_cache.dtype == FP8 and window is None:  # sliding layers need a window of the table
        upcast = upcast_blocks(k_cache, v_cache, block_tables)
        if upcast is not None:
            k_cache, v_cache, block_tables = upcast
    return launch_prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sinks, out,
        window=window, scale=scale,
    )  # fmt: skip


def kv_bytes_read(
    seq_lens: Sequence[int] | torch.Tensor, window: int | None, num_kv_heads: int, head_dim: int
) -> int:
    """Bytes of bf16 K and V one decode step must read: min(len, window) keys per sequence."""
    lengths = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    num_keys = sum(n if window is None else min(n, window) for n in lengths)
    return 2 * num_keys * num_kv_heads * head_dim * 2  # (K + V) x 2 bytes


def _check_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
) -> None:
    """The layout the kernels assume (see the module docstring)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache: same shape and dtype")
    check_cache(k_cache.dtype, q.dtype)
    if q.shape[-1] != head_dim or q.shape[1] % num_kv_heads or sinks.shape != (q.shape[1],):
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if block_size & (block_size - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError("block_size and head_dim (>= 16) must be powers of two")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q's and the caches' last dimension contiguous; K and V same strides")


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    return out


# ---------------------------------------------------------------------------------------------
# Plain-torch references (same signatures): gather each sequence's keys, call sink_attention.


def paged_attention_decode_reference(  # noqa: PLR0917  (the op's signature)
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode step is a prefill of one token per sequence (``max_seq_len`` is unused)."""
    one_each = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_prefill_reference(
        q, k_cache, v_cache, block_tables, one_each, seq_lens, sinks,
        window=window, scale=scale, out=out,
    )  # fmt: skip


def paged_attention_prefill_reference(  # noqa: PLR0917  (the op's signature)
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per sequence: gather only the keys its queries can see, then ``sink_attention``."""
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        first_query = seq_len - (rows.stop - rows.start)
        # Never touch blocks wholly before the window: their table entries may be -1.
        first_key = 0 if window is None else max(0, first_query - window + 1)
        table_row = block_tables[seq]
        out[rows] = sink_attention(
            q[rows],
            _gather(k_cache, table_row, first_key, seq_len).to(q.dtype),  # FP8: exact
            _gather(v_cache, table_row, first_key, seq_len).to(q.dtype),
            sinks,
            query_start=first_query,
            key_start=first_key,
            window=window,
            scale=scale,
        )
    return out


def _gather(cache: torch.Tensor, table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Keys or values at positions start..end-1 of one sequence: [end - start, KV, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(start, end, device=cache.device)
    blocks = table_row[positions // block_size].long()
    return cache[blocks, positions % block_size]
