"""The KV cache's element type: the activations' own, or FP8 (E4M3) at half the bytes.

``auto`` keeps K and V in the activations' dtype (bf16; float32 in the verification mode),
bit for bit what the model computed. ``fp8`` stores them as ``torch.float8_e4m3fn`` (the
``--kv-cache-dtype fp8`` of vLLM and SGLang, without calibrated scales): a cache holds twice
the tokens, so twice the sequences fit, and decode attention reads half the bytes. The price
is precision: E4M3 keeps 3 mantissa bits (relative rounding error up to 2^-4) and saturates at
±448, so the model's outputs move; they are no longer those of the bf16 model.

Writing (the reference ``to_cache`` and the Triton kernels alike): K after RoPE and V are first
the bf16 values the model computes, then saturated to ±448 and rounded to nearest-even E4M3
(``cvt.rn.satfinite`` on the GPU). Reading (``_attention_common.load_rows``): E4M3 -> bf16 is
exact, and the attention then runs as on a bf16 cache.

Prefill over full-attention layers reads no FP8 in its kernel: there the tiles converted in
registers must go back through shared memory for wgmma, which halved the kernel's speed (H100,
8192 tokens: 1,559 -> 3,132 us). ``upcast_blocks`` first copies the blocks of the prefill's
block tables to a bf16 scratch (a few MB a layer; the same values, so the same output).
"""

from __future__ import annotations

import torch

from gptoss_serve.config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value


def cache_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a KV cache for ``--kv-cache-dtype name`` under activations of
    ``activation_dtype``; fp8 only under bf16 activations (the float32 verification mode
    compares exact values)."""
    if name == "auto":
        return activation_dtype
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if activation_dtype != torch.bfloat16:
        raise ValueError(f"an fp8 KV cache needs bf16 activations, not {activation_dtype}")
    return FP8


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values as a cache of ``dtype`` stores them: the activations' rounding, then for FP8 the
    saturation to ±448 and round-to-nearest-even (torch's own conversion would give NaN past
    ±464)."""
    if dtype != FP8:
        return x.to(dtype)
    return x.to(torch.bfloat16).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def check_cache(cache_dtype_: torch.dtype, activation_dtype: torch.dtype) -> None:
    """A cache the attention ops read: the activations' dtype, or FP8 under bf16."""
    if cache_dtype_ != activation_dtype and (
        cache_dtype_ != FP8 or activation_dtype != torch.bfloat16
    ):
        raise ValueError(
            f"a KV cache of {cache_dtype_} under {activation_dtype} activations: the cache "
            "holds the activations' dtype, or float8_e4m3fn under bf16"
        )


# Most bytes of bf16 scratch (K and V) ``upcast_blocks`` may take: one 128k-token context of
# gpt-oss (2 x 131072 tokens x 8 KV heads x 64 x 2 bytes) inside the engine's reserve for
# transient buffers (startup.RESERVE_BYTES); beyond it the kernel reads the FP8 cache itself.
UPCAST_MAX_BYTES = 256 << 20


def upcast_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The blocks ``block_tables`` [S, W] names, from FP8 caches [blocks, page, KV, D] to bf16
    copies [S·W, page, KV, D], with the table that names them there (row s: s·W .. s·W + W - 1);
    None when the copies would exceed ``UPCAST_MAX_BYTES``. Entries that are -1 or past a
    sequence's end copy some block that no query reads. No host sync: the shapes come from the
    table's."""
    num_seqs, width = block_tables.shape
    page_bytes = k_cache[0].numel() * 2  # one block in bf16
    if 2 * num_seqs * width * page_bytes > UPCAST_MAX_BYTES:
        return None
    ids = block_tables.reshape(-1).clamp(0, k_cache.shape[0] - 1).long()
    keys = k_cache.view(torch.uint8).index_select(0, ids).view(FP8).to(torch.bfloat16)
    values = v_cache.view(torch.uint8).index_select(0, ids).view(FP8).to(torch.bfloat16)
    table = torch.arange(num_seqs * width, dtype=torch.int32, device=block_tables.device)
    return keys, values, table.view(num_seqs, width)
