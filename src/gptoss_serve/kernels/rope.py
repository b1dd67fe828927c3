"""Rotary position embedding, NeoX style: the head is split in two halves, not interleaved.

``rope_and_cache_write`` is the attention prologue in one pass: rotate q and k, and store the
rotated k and the plain v into the paged KV cache. On CUDA a Triton kernel (``_rope.py``),
elsewhere its torch reference.

``qkv_rope_and_cache_write`` is the whole prologue from the normed hidden state: the q/k/v
projection, then the same rotation and cache write. Where the projection is the decode GEMV
(``linear.GEMV_MAX_TOKENS`` tokens or fewer, bf16 on CUDA, with a cos/sin table from
``rope_cos_sin_table``) both run in one Triton kernel (``_qkv_rope.py``: one launch a layer
less), and from there up to ``QKV_MMA_MAX_TOKENS`` (64) likewise on the tensor cores
(``_qkv_rope_mma.py``, where ``linear`` takes cuBLAS from 17 tokens); otherwise it is
``linear`` then ``rope_and_cache_write``, which is also the reference.
"""

from __future__ import annotations

import torch

from gptoss_serve.kernels import linear
from gptoss_serve.kernels.kv_dtype import check_cache, to_cache
from gptoss_serve.kernels.launch import pdl_applies

# The fused tensor-core q/k/v kernel's tiles (``rows`` weight rows, whole heads, a program;
# None: the projection and the RoPE kernel apart) and the largest batch it serves (from
# linear.GEMV_MAX_TOKENS + 1), where cuBLAS takes the plain projections from 17 tokens. Whole
# 120b step on the H200 (bench/step_tiles.py --target dense, bench/RESULTS.md v24), fused
# against apart: batch 4 4.20 / 4.31 ms, 8 5.89 / 6.03, 16 9.08 / 9.25, 32 12.66 / 12.80-12.81
# (apart on cuBLAS), 64 17.34-17.48 / 17.49-18.05; two heads a program lost at 8 and 16.
QKV_MMA_TILES: linear.MmaTiles | None = linear.MMA_TILES
QKV_MMA_MAX_TOKENS = 64


def whole_heads(tiles: linear.MmaTiles, head_dim: int) -> bool:
    """Whether the fused tensor-core kernel runs these tiles for heads of ``head_dim``: whole
    heads a program, a power-of-two number of rows."""
    rows = tiles.rows
    return rows % head_dim == 0 and rows & (rows - 1) == 0


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, head_dim/2] in float32, scaled by YaRN's concentration."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos() * scaling, angles.sin() * scaling


def rope_cos_sin_table(num_positions: int, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """[num_positions, head_dim] float32: cos | sin (``rope_cos_sin``) of positions 0, 1, ...,
    made once at load for the fused q/k/v kernel."""
    positions = torch.arange(num_positions, device=inv_freq.device)
    return torch.cat(rope_cos_sin(positions, inv_freq, scaling), dim=1).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim/2]. Returns x rotated, in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> None:
    num_tokens, _, head_dim = q.shape
    if head_dim % 2 or k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache {tuple(k_cache.shape)} is not [blocks, block_size, KV, D]")
    check_cache(k_cache.dtype, k.dtype)


def rope_and_cache_write(  # noqa: PLR0917 (one positional argument per tensor)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotates q [T, A, D] and k [T, KV, D]; returns the rotated q, in q's dtype.

    positions [T] int; inv_freq [D/2] float32 (YaRN); cos/sin are multiplied by ``scaling``.
    The rotated k and the plain v [T, KV, D] go to the caches [num_blocks, block_size, KV, D]
    at slot = slot_mapping[t] (block slot // block_size, row slot % block_size); a slot of -1
    (padding of a CUDA-graph batch) writes nothing. ``pdl``: a programmatic dependent launch
    where that applies (kernels/launch.py).
    """
    _check(q, k, v, k_cache)
    if q.is_cuda:
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._rope import rope_and_cache_write_triton  # noqa: PLC0415

        return rope_and_cache_write_triton(
            q, k, v, positions, inv_freq, scaling, k_cache, v_cache, slot_mapping,
            pdl=pdl_applies(pdl, q),
        )  # fmt: skip
    return rope_and_cache_write_reference(
        q, k, v, positions, inv_freq, scaling, k_cache, v_cache, slot_mapping
    )


def rope_and_cache_write_reference(  # noqa: PLR0917 (the op's signature)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Plain torch: the numerics the kernel is checked against."""
    cos, sin = rope_cos_sin(positions, inv_freq, scaling)
    written = slot_mapping >= 0
    slots = slot_mapping[written]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Indexing with (block, offset) pairs writes through views of a larger cache tensor too.
    k_cache[blocks, offsets] = to_cache(apply_rope(k, cos, sin)[written], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache(v[written], v_cache.dtype)
    return apply_rope(q, cos, sin)


def qkv_rope_and_cache_write(  # noqa: PLR0917 (one positional argument per tensor)
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    cos_sin: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, H] (normed), qkv_weight [(A + 2 KV)·D, H], qkv_bias [(A + 2 KV)·D] -> the rotated
    q [T, A, D]; the rotated k and the plain v go to the caches as in ``rope_and_cache_write``
    (D is the caches' last dimension). ``cos_sin``: ``rope_cos_sin_table`` of these
    ``inv_freq`` and ``scaling`` over every position the caller may pass; the fused kernel
    needs it (without it: the projection, then ``rope_and_cache_write``)."""
    head_dim = k_cache.shape[-1]
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv_weight.shape[0] != rows or qkv_bias.shape != (rows,):
        raise ValueError(
            f"qkv weight {tuple(qkv_weight.shape)} / bias {tuple(qkv_bias.shape)} do not have "
            f"(A + 2 KV) * D = {rows} rows"
        )
    # The fused kernel is the decode GEMV with a RoPE epilogue: it runs where the GEMV would.
    if cos_sin is not None and x.is_cuda and linear.gemv_applies(x, qkv_weight, x.dtype):
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._qkv_rope import qkv_rope_triton  # noqa: PLC0415

        return qkv_rope_triton(
            x, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache, slot_mapping,
            num_heads=num_heads, num_kv_heads=num_kv_heads,
            tiles=linear.gemv_tiles_for(*qkv_weight.shape, x.shape[0]), pdl=pdl_applies(pdl, x),
        )  # fmt: skip
    # From 3 tokens to QKV_MMA_MAX_TOKENS: the tensor-core projection with the same epilogue.
    tiles = QKV_MMA_TILES
    if (
        cos_sin is not None
        and x.is_cuda
        and tiles is not None
        and whole_heads(tiles, head_dim)
        and linear.mma_applies(x, qkv_weight, x.dtype, QKV_MMA_MAX_TOKENS)
    ):
        from gptoss_serve.kernels._qkv_rope import qkv_rope_triton  # noqa: PLC0415

        return qkv_rope_triton(
            x, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache, slot_mapping,
            num_heads=num_heads, num_kv_heads=num_kv_heads, tiles=tiles, pdl=pdl_applies(pdl, x),
        )  # fmt: skip
    qkv = linear.linear(x, qkv_weight, qkv_bias, pdl=pdl)
    return rope_and_cache_write(
        *split_qkv(qkv, num_heads, num_kv_heads, head_dim), positions, inv_freq, scaling,
        k_cache, v_cache, slot_mapping, pdl=pdl,
    )  # fmt: skip


def qkv_rope_and_cache_write_reference(  # noqa: PLR0917 (the op's signature)
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: the projection, then ``rope_and_cache_write_reference`` (``cos_sin`` is
    not needed: the reference computes the same values)."""
    del cos_sin
    qkv = linear.linear_reference(x, qkv_weight, qkv_bias)
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    return rope_and_cache_write_reference(
        q, k, v, positions, inv_freq, scaling, k_cache, v_cache, slot_mapping
    )


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (A + 2 KV)·D] -> views q [T, A, D], k and v [T, KV, D]."""
    num_tokens = qkv.shape[0]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
