"""Programmatic dependent launch (PDL) for the chain of kernels of a decode step.

A decode step is ~300 short kernels in a row, each of which, launched plainly, starts only
once the one before has drained: its launch, its first loads from HBM and the previous
kernel's tail do not overlap. Launched with PDL (Hopper on), a kernel's programs may start
as soon as every program of the kernel before has called ``gdc_launch_dependents``; they do
what needs nothing from earlier kernels (the GEMVs load their weights, the norms their gains)
and then wait in ``gdc_wait`` until the previous kernel has finished and its writes are
visible. Where each kernel calls ``gdc_launch_dependents`` was measured (bench/pdl_step.py):
the GEMVs and norms at their start, RoPE and attention after their wait, the MoE decode
kernels after their GEMV loop (earlier, kernels launched several ahead sat waiting beside
the MoE's weight stream and slowed it 1.5x), except at 1-2 tokens the router's (1 token)
and down's: there the norm and q/k/v after down load their gains and weights beside its
stream (_moe_tiles.DECODE_TILES).

The rule that keeps this correct: every kernel launched with PDL calls ``gdc_wait`` in every
program before it reads anything an earlier kernel wrote and before it writes anything. Then
a kernel finishes only after its predecessor has, so "the previous kernel finished" also
means every earlier one did. Kernels launched plainly (torch's) just wait as usual.
"""

from __future__ import annotations

import functools

import torch


def pdl_applies(requested: bool, tensor: torch.Tensor) -> bool:
    """Whether to launch with PDL: asked for, on a CUDA device of compute capability 9 or
    more, and not under Triton's interpreter."""
    if not requested or not tensor.is_cuda:
        return False
    import triton  # noqa: PLC0415 (a GPU-only dependency)

    if triton.knobs.runtime.interpret:
        return False
    return _capability(tensor.device.index or 0) >= 9


@functools.cache
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]
