"""The engine's op tables and how the CLI picks them: kernel_ops(pdl=True) launches the decode
step's kernels with programmatic dependent launch (kernels/launch.py), --no-pdl turns it off,
and off the GPU the PDL table computes exactly what the plain one does."""

from __future__ import annotations

import torch

from gptoss_serve.cli import build_parser, engine_config
from gptoss_serve.engine.ops import KERNEL_OPS, kernel_ops


def test_cli_programmatic_launch_flag() -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", "--model", "demo"])).programmatic_launch
    assert not engine_config(
        parser.parse_args(["serve", "--model", "demo", "--no-pdl"])
    ).programmatic_launch
    assert not engine_config(parser.parse_args(["bench", "--no-pdl"])).programmatic_launch


def test_kernel_ops_with_pdl_compute_the_same_off_the_gpu() -> None:
    assert kernel_ops(pdl=False) is KERNEL_OPS
    ops = kernel_ops(pdl=True)
    for name in ("linear", "fused_add_rms_norm", "qkv_rope_and_cache_write", "attention_decode"):
        assert getattr(ops, name).keywords == {"pdl": True}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator)
    weight, bias = torch.randn(16, 64, generator=generator), torch.randn(16, generator=generator)
    assert torch.equal(ops.linear(x, weight, bias), KERNEL_OPS.linear(x, weight, bias))
    gain = torch.rand(64, generator=generator)
    for a, b in zip(
        ops.fused_add_rms_norm(x, x, gain, 1e-5),
        KERNEL_OPS.fused_add_rms_norm(x, x, gain, 1e-5),
        strict=True,
    ):
        assert torch.equal(a, b)
