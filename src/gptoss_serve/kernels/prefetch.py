"""Pull tensors (or some experts' slices of them) into the GPU's L2 ahead of their use.

A decode step is a chain of memory-bound kernels, several of which cannot keep HBM busy on
their own (latency-bound attention and norms at batch 1, the MXFP4 GEMVs' instruction
count). ``l2_prefetch`` asks the copy engines to fetch a weight into L2 while such a kernel
runs, so that the kernel that reads it next finds it there. The requests are hints: they
change no value, so the reference is to do nothing, and off the GPU nothing is done.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

CHUNK = 16384  # bytes per bulk request (one per thread)
THREADS = 128  # requests per program: 2 MB a program, spread over the SMs


def l2_prefetch(tensor: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    """Prefetch ``tensor`` (contiguous), or with ``ids`` (int [n] on the device) its slices
    ``tensor[ids[i]]`` along dimension 0, into L2. No host sync; graph-capturable."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        if tensor.is_cuda:
            logger.debug("l2_prefetch skipped: tensor not contiguous")
        return
    from gptoss_serve.kernels._prefetch import _prefetch_kernel  # noqa: PLC0415 (no triton on CPU)

    flat = tensor.view(torch.uint8)
    if ids is None:
        nbytes, stride, grid_ids = flat.numel(), 0, 1
    else:
        stride = tensor.stride(0) * tensor.element_size()
        nbytes, grid_ids = stride, ids.numel()
    programs = -(-nbytes // (CHUNK * THREADS))
    _prefetch_kernel[(programs, grid_ids)](
        flat, flat if ids is None else ids, nbytes, stride,
        CHUNK=CHUNK, THREADS=THREADS, INDEXED=ids is not None, num_warps=4,
    )  # fmt: skip


def l2_prefetch_reference(tensor: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    """The reference: a prefetch changes no value."""
    del tensor, ids
