"""Rotary position embedding, NeoX style: the head is split in two halves, not interleaved.

``rope_and_cache_write`` is the attention prologue in one pass: rotate q and k, and store the
rotated k and the plain v into the paged KV cache. On CUDA a Triton kernel (``_rope.py``),
elsewhere its torch reference.
"""

from __future__ import annotations

import torch

from gptoss_serve.kernels.launch import pdl_applies


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, head_dim/2] in float32, scaled by YaRN's concentration."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos() * scaling, angles.sin() * scaling


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
    k_cache[blocks, offsets] = apply_rope(k, cos, sin)[written].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[written].to(v_cache.dtype)
    return apply_rope(q, cos, sin)
