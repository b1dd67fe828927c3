"""Shared by test_moe.py (reference, grouped path) and test_moe_decode.py (decode path):
random checkpoint-layout weights, the fp32 routing both paths are fed, the comparisons.

Tolerance of the Triton path against the fp32 reference, bf16-level: the kernels differ from
it only by (1) the SwiGLU output h rounded to bf16 before the down GEMM (the tensor cores take
bf16), (2) fp32 summation order, and (3) the final bf16 rounding, which the reference also
does. Under the interpreter (1)-(3) reproduce the kernel exactly: rms_rel ≈ 2.3e-3, max_rel
≈ 2.5e-3 on random data, so max_rel 2e-2 / rms_rel 5e-3 leave a margin for K = 2880 on the GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from compare import assert_close, poisoned

from gptoss_serve.kernels.moe import (
    MoeWeights,
    mxfp4_moe_experts_reference,
    route,
    router_logits_reference,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1",
)
logger = logging.getLogger(__name__)
MAX_REL, RMS_REL = 2e-2, 5e-3
E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)


def random_weights(
    num_experts: int, hidden: int, inter: int, *, device: str = "cpu", seed: int = 0
) -> MoeWeights:
    """Random checkpoint-layout weights with checkpoint/synthetic.py's scales: gate/up
    pre-activations with std ~4 (so the ±7 clamps bind), outputs with std ~1, every E2M1 code
    and three exponents per tensor."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        values = torch.randn(shape, generator=generator, device=device) * std
        return values.to(torch.bfloat16)

    def packed(rows: int, fan_in: int, target_std: float) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_experts, rows, fan_in // 32)
        u8 = {"generator": generator, "device": device, "dtype": torch.uint8}
        blocks = torch.randint(0, 256, (*shape, 16), **u8)
        base = 127 + round(math.log2(target_std / E2M1_RMS))
        return blocks, torch.randint(base - 1, base + 2, shape, **u8)

    gate_up = packed(2 * inter, hidden, 4.0 / math.sqrt(hidden))
    down = packed(hidden, inter, 1.0 / (10.0 * math.sqrt(inter)))
    return MoeWeights.from_checkpoint(
        normal(num_experts, hidden, std=1.0 / math.sqrt(hidden)),
        normal(num_experts, std=0.1),
        *gate_up,
        normal(num_experts, 2 * inter, std=0.5),
        *down,
        normal(num_experts, hidden, std=0.1),
    )


def random_x(num_tokens: int, hidden: int, *, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=generator, device=device).bfloat16()


def fresh_seed() -> int:
    """A new seed every run (logged, so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    logger.info("seed %d", seed)
    return seed


def reference_routing(x: torch.Tensor, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_ids, routing_weights) [T, 4] from fp32 logits: computed once, fed to both."""
    routing_weights, expert_ids = route(router_logits_reference(x, weights), 4)
    return expert_ids, routing_weights


def assert_same_routing(
    ids: torch.Tensor,
    weights: torch.Tensor,
    expected_ids: torch.Tensor,
    expected_weights: torch.Tensor,
) -> None:
    """Each token's experts and their weights equal the expected ones, in any order within the
    top-k: near-equal logits inside the top 4 may come out in either order (fp32 summation
    order), which changes only the rounding of the experts' sum."""
    order = ids.long().argsort(dim=1)
    expected_order = expected_ids.long().argsort(dim=1)
    assert torch.equal(ids.long().gather(1, order), expected_ids.long().gather(1, expected_order))
    assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order),
                 max_rel=1e-5, rms_rel=1e-5)  # fmt: skip


def clear_tokens(x: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
    """[T] bool: tokens whose 4th and 5th fp32 logits differ by more than 1e-4. On the others
    either expert is right and fp32 summation order (~1e-7 here) decides."""
    logits = router_logits_reference(x, weights)
    if weights.num_experts <= 4:  # every expert is chosen
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    top5 = logits.topk(5).values
    clear = (top5[:, 3] - top5[:, 4]) > 1e-4
    assert int((~clear).sum()) <= max(1, x.shape[0] // 100)  # ~0.07% of random tokens
    return clear


def check_against_reference(x: torch.Tensor, weights: MoeWeights, tiles=None) -> None:
    """The GEMM half with the fp32 routing given, into a poisoned output and scratch."""
    from gptoss_serve.kernels._moe_triton import moe_experts_triton  # noqa: PLC0415

    expert_ids, routing_weights = reference_routing(x, weights)
    out = poisoned(tuple(x.shape), torch.bfloat16, str(x.device))
    actual = moe_experts_triton(
        x, weights, expert_ids, routing_weights, tiles=tiles, out=out, poison=True
    )
    expected = mxfp4_moe_experts_reference(x, weights, expert_ids, routing_weights)
    assert actual is out
    assert_close(actual, expected, max_rel=MAX_REL, rms_rel=RMS_REL)


# The decode kernels' pointer types at 120b shapes, as the launches give them.
SM90_POINTERS = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16",
                 "x_thread_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16",
                 "logits_ptr": "*fp32", "routing_weights_ptr": "*fp32",
                 "blocks_ptr": "*u8", "scales_ptr": "*u8"}  # fmt: skip


def router_constexprs(tiles, num_tokens: int) -> dict:
    """The decode router's constexprs at 120b shapes as launch_router gives them under
    ``tiles`` (BLOCK_K: all of H up to 4 tokens, 16384 / T columns beyond)."""
    from gptoss_serve.kernels._moe_small import router_block_k  # noqa: PLC0415

    block_k = router_block_k(tiles, num_tokens, 2880)
    return dict(H=2880, E=128, T_PAD=num_tokens, BLOCK_E=tiles.router_experts, BLOCK_K=block_k,
                PDL=tiles.pdl, TOP_K=4, ROUTE=tiles.route_in_router,
                PRELOAD=tiles.router_preload, TILE_ORDER=tiles.order,
                EARLY=tiles.router_early_dependents)  # fmt: skip


def compile_sm90(kernel, constexprs: dict, pointers: dict, options: dict) -> str:
    """PTX of ``kernel`` compiled by Triton's own ptxas for sm_90 (no GPU needed), with 16-byte
    aligned pointers and integer arguments (as at 120b shapes)."""
    return _compiled_sm90(kernel, constexprs, pointers, options).asm["ptx"]


def sm90_registers(kernel, constexprs: dict, pointers: dict, options: dict) -> int:
    """Registers a thread of ``kernel`` compiled as ``compile_sm90`` does, read from the cubin
    by the cuobjdump that ships with Triton."""
    import triton  # noqa: PLC0415

    compiled = _compiled_sm90(kernel, constexprs, pointers, options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    return int(re.search(r"REG:(\d+)", usage).group(1))


def _compiled_sm90(kernel, constexprs: dict, pointers: dict, options: dict):
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    defaults = {  # constexpr parameters with a default, unless given (LB: the blocks' step rows)
        param.name: param.default
        for param in kernel.params
        if param.is_constexpr and param.default is not inspect.Parameter.empty
    }
    constexprs = defaults | constexprs
    scalars = {"alpha": "fp32", "limit": "fp32"}
    signature = {  # in argument order
        name: "constexpr"
        if name in constexprs
        else pointers.get(name, "*i32")
        if name.endswith("_ptr")
        else scalars.get(name, "i32")
        for name in kernel.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name] != "constexpr" and name not in scalars
    }
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
