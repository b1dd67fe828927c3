"""The fused MXFP4 MoE: the plain-torch reference (CPU), the Triton path under the interpreter
(small ragged shapes) and on the GPU (120b/20b shapes), all through compare.assert_close.

Tolerance of the Triton path against the fp32 reference, bf16-level: the kernels differ from
it only by (1) the SwiGLU output h rounded to bf16 before the down GEMM (the tensor cores take
bf16), (2) fp32 summation order, and (3) the final bf16 rounding, which the reference also
does. Under the interpreter (1)-(3) reproduce the kernel exactly: rms_rel ≈ 2.3e-3, max_rel
≈ 2.5e-3 on random data, so max_rel 2e-2 / rms_rel 5e-3 leave a margin for K = 2880 on the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os

import pytest
import torch
from compare import assert_close, poisoned

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.moe import (
    CHECKPOINT_TENSORS,
    MoeWeights,
    moe,
    mxfp4_moe,
    mxfp4_moe_bytes,
    mxfp4_moe_experts_reference,
    mxfp4_moe_flops,
    mxfp4_moe_reference,
    route,
    router_logits_reference,
)
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from gptoss_serve.model.layers import MLP

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


# -- CPU: the reference ----------------------------------------------------------------------


def test_reference_matches_moe_with_dequantized_weights() -> None:
    weights = random_weights(8, 64, 96)
    x = random_x(5, 64)
    expert_ids, routing_weights = reference_routing(x, weights)
    dense = (
        dequantize_mxfp4(weights.gate_up_blocks, weights.gate_up_scales, torch.float32),
        dequantize_mxfp4(weights.down_blocks, weights.down_scales, torch.float32),
    )
    expected = moe(
        x.float(),
        routing_weights,
        expert_ids,
        lambda e: (dense[0][e], dense[1][e]),
        gate_up_bias=weights.gate_up_bias.float(),
        down_bias=weights.down_bias.float(),
        alpha=1.702,
        limit=7.0,
    )
    actual = mxfp4_moe_reference(x.float(), weights)
    assert torch.equal(actual, expected)
    assert torch.equal(mxfp4_moe_reference(x, weights), expected.to(torch.bfloat16))


def test_reference_matches_model_mlp() -> None:
    """The model's MLP (router, route, moe over packed experts) in fp32 computes the same."""
    raw = preset_config("tiny", hidden=64, intermediate=96, experts=8)
    config = ModelConfig.from_dict(raw)
    weights = random_weights(8, 64, 96, seed=3)
    mlp = MLP(config)
    state = {
        "router.weight": weights.router_weight.float(),
        "router.bias": weights.router_bias.float(),
        "experts.gate_up_proj_blocks": weights.gate_up_blocks,
        "experts.gate_up_proj_scales": weights.gate_up_scales,
        "experts.gate_up_proj_bias": weights.gate_up_bias.float(),
        "experts.down_proj_blocks": weights.down_blocks,
        "experts.down_proj_scales": weights.down_scales,
        "experts.down_proj_bias": weights.down_bias.float(),
    }
    mlp.load_state_dict(state, strict=True, assign=True)
    x = random_x(7, 64).float()
    assert_close(mxfp4_moe_reference(x, weights), mlp(x), max_rel=1e-5, rms_rel=1e-6)


def test_from_checkpoint_keeps_the_checkpoint_tensors() -> None:
    weights = random_weights(4, 64, 32, seed=5)
    tensors = [getattr(weights, name) for name in CHECKPOINT_TENSORS]
    # A transposed-back copy is not contiguous: from_checkpoint must still see the same values.
    tensors[2] = tensors[2].transpose(0, 1).contiguous().transpose(0, 1)
    again = MoeWeights.from_checkpoint(*tensors)
    for name, original in zip(CHECKPOINT_TENSORS, tensors, strict=True):
        assert torch.equal(getattr(again, name), original), name
        assert getattr(again, name).is_contiguous()
    assert again.gate_up_blocks.untyped_storage().nbytes() == tensors[2].numel()  # no extra copy
    x = random_x(3, 64)
    assert torch.equal(mxfp4_moe_reference(x, again), mxfp4_moe_reference(x, weights))


def test_from_checkpoint_rejects_mismatched_tensors() -> None:
    weights = random_weights(4, 64, 32)
    tensors = [getattr(weights, name) for name in CHECKPOINT_TENSORS]
    with pytest.raises(ValueError, match="down_scales"):
        MoeWeights.from_checkpoint(*tensors[:6], tensors[6][:, :-1], tensors[7])
    with pytest.raises(TypeError, match="gate_up_bias"):
        MoeWeights.from_checkpoint(*tensors[:4], tensors[4].float(), *tensors[5:])


def test_cpu_dispatches_to_the_reference() -> None:
    weights = random_weights(8, 64, 32, seed=7)
    x = random_x(4, 64)
    assert torch.equal(mxfp4_moe(x, weights), mxfp4_moe_reference(x, weights))
    assert torch.equal(mxfp4_moe(x.float(), weights), mxfp4_moe_reference(x.float(), weights))


def test_bytes_and_flops_at_120b_shapes() -> None:
    meta = torch.device("meta")
    weights = MoeWeights(
        *(
            torch.empty(shape, dtype=dtype, device=meta)
            for shape, dtype in [
                ((128, 2880), torch.bfloat16), ((128,), torch.bfloat16),
                ((128, 5760, 90, 16), torch.uint8), ((128, 5760, 90), torch.uint8),
                ((128, 5760), torch.bfloat16),
                ((128, 2880, 90, 16), torch.uint8), ((128, 2880, 90), torch.uint8),
                ((128, 2880), torch.bfloat16),
            ]
        )
    )  # fmt: skip
    weights.check()
    assert weights.expert_bytes() == 13_236_480
    assert mxfp4_moe_bytes(1, weights, torch.tensor([[3, 9, 5, 70]])) == 4 * 13_236_480
    assert mxfp4_moe_bytes(1, weights) == 4 * 13_236_480  # expected distinct experts
    assert mxfp4_moe_bytes(64, weights) == 111 * 13_236_480
    assert mxfp4_moe_flops(1, weights) == 2 * 4 * 3 * 2880 * 2880


# -- the Triton path: shared checks ------------------------------------------------------------


def check_dequant_bit_exact(device: str) -> None:
    """Every E2M1 code in both nibbles under 52 scales, plus a random full-width row set."""
    from gptoss_serve.kernels._moe_triton import dequantize_mxfp4_triton  # noqa: PLC0415

    codes = torch.arange(16, dtype=torch.uint8, device=device)
    one_block = codes | ((15 - codes) << 4)  # byte k: code k (even), code 15 - k (odd)
    exponents = torch.arange(-21, 31, device=device)  # 52 scales, 4 rows of 13 groups
    blocks = one_block.expand(52, 16).reshape(4, 13, 16).contiguous()
    scales = (127 + exponents).to(torch.uint8).reshape(4, 13)
    random_blocks = torch.randint(0, 256, (7, 90, 16), dtype=torch.uint8, device=device)
    random_scales = torch.randint(100, 140, (7, 90), dtype=torch.uint8, device=device)
    for b, s in [(blocks, scales), (random_blocks, random_scales)]:
        expected = dequantize_mxfp4(b, s, torch.bfloat16).view(torch.int16)
        for ptx in (True, False):  # the inline-PTX decode and the portable one (GPU: both run)
            actual = dequantize_mxfp4_triton(b, s, ptx=ptx)
            assert torch.equal(actual.view(torch.int16), expected), f"ptx={ptx}"


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


def check_routing(x: torch.Tensor, weights: MoeWeights, tiles) -> None:
    """Top-4 ids equal torch.topk's on fp32 logits, weights agree, grouping is consistent."""
    from gptoss_serve.kernels._moe_triton import route_triton  # noqa: PLC0415

    expert_ids, routing_weights, grouping = route_triton(x, weights, top_k=4, tiles=tiles)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert torch.equal(expert_ids[clear].long(), expected_ids[clear])
    assert_close(routing_weights[clear], expected_weights[clear], max_rel=1e-5, rms_rel=1e-5)
    num_pairs = expert_ids.numel()
    order = grouping.sorted_pair_ids.long()
    assert torch.equal(order.sort().values, torch.arange(num_pairs, device=x.device))
    sorted_experts = expert_ids.flatten()[order]
    assert bool((sorted_experts[1:] >= sorted_experts[:-1]).all())
    live = int(grouping.num_blocks.item())
    table = grouping.block_table[:, :live].long()
    assert live == sum(
        -(-int(count) // tiles.block_m) for count in torch.bincount(expert_ids.flatten())
    )
    assert torch.equal(sorted_experts[table[1]], table[0])  # each block starts in its expert
    assert bool((table[2] > table[1]).all())


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


# -- the Triton path under the interpreter (CPU tensors) ---------------------------------------


def _regimes() -> list:
    if not INTERPRETING:
        return [None]
    from gptoss_serve.kernels._moe_triton import DECODE_TILES, PREFILL_TILES  # noqa: PLC0415

    return [DECODE_TILES[0][1], PREFILL_TILES[0][1]]  # one-program routing; atomic grouping


@interpreter
def test_interpreter_dequant_bit_exact() -> None:
    check_dequant_bit_exact("cpu")


@interpreter
@pytest.mark.parametrize("tiles", _regimes(), ids=["decode", "prefill"][: len(_regimes())])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_interpreter_matches_reference(num_tokens: int, tiles) -> None:
    weights = random_weights(8, 96, 64, seed=num_tokens)  # H ≠ I, K = 96: a masked K tail
    x = random_x(num_tokens, 96, seed=num_tokens + 1)
    check_routing(x, weights, tiles)
    check_against_reference(x, weights, tiles)


@interpreter
def test_interpreter_full_op() -> None:
    from gptoss_serve.kernels._moe_triton import mxfp4_moe_triton  # noqa: PLC0415

    weights = random_weights(8, 64, 128, seed=11)
    x = random_x(5, 64, seed=12)
    expected = mxfp4_moe_reference(x, weights)
    assert_close(
        mxfp4_moe_triton(x, weights, poison=True), expected, max_rel=MAX_REL, rms_rel=RMS_REL
    )


# -- the Triton path on the GPU, real shapes -----------------------------------------------------

GPU_TOKENS = [1, 7, 64, 300, 2048]


@pytest.fixture(scope="module", params=[128, 32], ids=["120b", "20b"])
def gpu_weights(request: pytest.FixtureRequest) -> MoeWeights:
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true fp32
    return random_weights(request.param, 2880, 2880, device="cuda", seed=fresh_seed())


@pytest.mark.gpu
def test_gpu_dequant_bit_exact() -> None:
    check_dequant_bit_exact("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_gpu_experts_match_reference(gpu_weights: MoeWeights, num_tokens: int) -> None:
    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    check_against_reference(x, gpu_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [7, 2048])
def test_gpu_portable_dequant_matches_reference(gpu_weights: MoeWeights, num_tokens: int) -> None:
    """The fallback decode (ptx_dequant=False) through the same GEMMs."""
    from gptoss_serve.kernels._moe_triton import tiles_for  # noqa: PLC0415

    tiles = dataclasses.replace(tiles_for(num_tokens, gpu_weights.num_experts), ptx_dequant=False)
    check_against_reference(
        random_x(num_tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights, tiles
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_gpu_routing(gpu_weights: MoeWeights, num_tokens: int) -> None:
    from gptoss_serve.kernels._moe_triton import tiles_for  # noqa: PLC0415

    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    check_routing(x, gpu_weights, tiles_for(num_tokens, gpu_weights.num_experts))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
def test_gpu_full_op(gpu_weights: MoeWeights, num_tokens: int) -> None:
    """mxfp4_moe end to end, on the tokens without a near-tie at the 4th expert."""
    x = random_x(num_tokens, 2880, device="cuda", seed=fresh_seed())
    clear = clear_tokens(x, gpu_weights)
    actual, expected = mxfp4_moe(x, gpu_weights), mxfp4_moe_reference(x, gpu_weights)
    assert_close(actual[clear], expected[clear], max_rel=MAX_REL, rms_rel=RMS_REL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 300])
def test_gpu_graph_capture_and_determinism(gpu_weights: MoeWeights, num_tokens: int) -> None:
    """No host sync (a CUDA graph captures the whole op) and bitwise repeatable results, the
    atomic grouping of prefill included."""
    x = random_x(num_tokens, 2880, device="cuda")
    eager = mxfp4_moe(x, gpu_weights)
    assert torch.equal(mxfp4_moe(x, gpu_weights), eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mxfp4_moe(x, gpu_weights)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mxfp4_moe(x, gpu_weights)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


# -- the decode path (T ≤ DECODE_MAX_TOKENS: router, GEMV gate_up, GEMV down + top-k sum) ------


def check_decode_bit_exact(device: str, ptx_choices: tuple[bool, ...]) -> None:
    """The GEMV decode of every code in both nibbles under 52 scales and the edges of its exact
    range (64 ≤ s ≤ 190), plus random bytes, against the reference times 2^-62, in tile order."""
    from gptoss_serve.kernels._moe_small import decode_debug  # noqa: PLC0415

    codes = torch.arange(16, dtype=torch.uint8, device=device)
    one_block = codes | ((15 - codes) << 4)
    exponents = [*range(106, 158), 64, 65, 127, 189, 190]
    blocks = one_block.expand(len(exponents), 16).contiguous()
    scales = torch.tensor(exponents, dtype=torch.uint8, device=device)
    random_blocks = torch.randint(0, 256, (77, 16), dtype=torch.uint8, device=device)
    random_scales = torch.randint(100, 140, (77,), dtype=torch.uint8, device=device)
    column = torch.arange(32, device=device)  # tile column 8q + 4m + 2p + h: element 8q+2m+p+4h
    element = 8 * (column // 8) + 2 * (column // 4 % 2) + column // 2 % 2 + 4 * (column % 2)
    for b, sc in [(blocks, scales), (random_blocks, random_scales)]:
        values = dequantize_mxfp4(b[:, None, :], sc[:, None], torch.float32)[:, element]
        expected = (values * 2.0**-62).to(torch.bfloat16).view(torch.int16)
        for ptx in ptx_choices:
            actual = decode_debug(b, sc, ptx=ptx)
            assert torch.equal(actual.view(torch.int16), expected), f"ptx={ptx}"


def check_decode_routing(x: torch.Tensor, weights: MoeWeights, tiles=None) -> None:
    """The 3-launch path end to end: top-k ids and weights written by gate_up equal the fp32
    reference's on clear tokens, and so does the output."""
    from gptoss_serve.kernels._moe_small import mxfp4_moe_decode  # noqa: PLC0415

    out = poisoned(tuple(x.shape), torch.bfloat16, str(x.device))
    result = mxfp4_moe_decode(x, weights, tiles=tiles, out=out, poison=True)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert result.out is out
    assert torch.equal(result.expert_ids[clear].long(), expected_ids[clear])
    assert_close(result.routing_weights[clear], expected_weights[clear], max_rel=1e-5, rms_rel=1e-5)
    expected = mxfp4_moe_reference(x, weights)
    assert_close(result.out[clear], expected[clear], max_rel=MAX_REL, rms_rel=RMS_REL)


def _decode_variants() -> list:
    """Launch shapes the tests cover: the table's entries, a K split of 4, tiles that do not
    divide N (rows clamped), one warp per program, the portable decode, PDL, unrolled steps."""
    if importlib.util.find_spec("triton") is None:
        return []
    from gptoss_serve.kernels._moe_small import DECODE_TILES, DecodeTiles  # noqa: PLC0415

    return [tiles for _, tiles in DECODE_TILES] + [
        DecodeTiles(
            gate_up_rows=128,
            gate_up_split=1,
            gate_up_warps=4,
            down_rows=64,
            down_split=1,
            down_warps=8,
        ),
        DecodeTiles(gate_up_rows=16, gate_up_split=4, gate_up_warps=1, down_rows=4, down_warps=1),
        DecodeTiles(gate_up_rows=64, gate_up_split=1, router_experts=2, ptx=False),
        DecodeTiles(pdl=True),
        DecodeTiles(gate_up_stages=2, gate_up_unroll=4, down_stages=3, down_unroll=2),
    ]


@interpreter
def test_interpreter_decode_bit_exact() -> None:
    check_decode_bit_exact("cpu", (False,))


@interpreter
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_interpreter_decode_matches_reference(num_tokens: int, variant: int) -> None:
    """H = 160 (5 groups: a partial step), 2I = 192; given routing, poisoned buffers."""
    from gptoss_serve.kernels._moe_small import mxfp4_moe_decode  # noqa: PLC0415

    weights = random_weights(8, 160, 96, seed=20 + num_tokens)
    x = random_x(num_tokens, 160, seed=variant)
    expert_ids, routing_weights = reference_routing(x, weights)
    out = poisoned(tuple(x.shape), torch.bfloat16, "cpu")
    mxfp4_moe_decode(
        x, weights, tiles=_decode_variants()[variant], out=out, poison=True,
        expert_ids=expert_ids, routing_weights=routing_weights,
    )  # fmt: skip
    expected = mxfp4_moe_experts_reference(x, weights, expert_ids, routing_weights)
    assert_close(out, expected, max_rel=MAX_REL, rms_rel=RMS_REL)


@interpreter
def test_interpreter_decode_routing() -> None:
    check_decode_routing(random_x(6, 96, seed=31), random_weights(8, 96, 64, seed=30))


@pytest.mark.gpu
def test_gpu_decode_bit_exact() -> None:
    check_decode_bit_exact("cuda", (True, False))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, "max", "max+1"])
def test_gpu_decode_matches_reference(gpu_weights: MoeWeights, num_tokens) -> None:
    """Through moe_experts_triton's dispatch, up to and just past the switch to the grouped
    path (DECODE_MAX_TOKENS)."""
    from gptoss_serve.kernels._moe_small import DECODE_MAX_TOKENS  # noqa: PLC0415

    tokens = {"max": DECODE_MAX_TOKENS, "max+1": DECODE_MAX_TOKENS + 1}.get(num_tokens, num_tokens)
    check_against_reference(random_x(tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_gpu_decode_routing(gpu_weights: MoeWeights, num_tokens: int) -> None:
    check_decode_routing(random_x(num_tokens, 2880, device="cuda", seed=fresh_seed()), gpu_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
def test_gpu_decode_tile_variants(gpu_weights: MoeWeights, variant: int) -> None:
    """Every covered launch shape, with the routing computed in-kernel (3 tokens)."""
    x = random_x(3, 2880, device="cuda", seed=fresh_seed())
    check_decode_routing(x, gpu_weights, _decode_variants()[variant])


# -- the GEMMs compile for Hopper (Triton's own ptxas; no GPU needed) ----------------------------


def _all_regimes() -> list:
    if importlib.util.find_spec("triton") is None:
        return []
    from gptoss_serve.kernels._moe_triton import DECODE_TILES, PREFILL_TILES  # noqa: PLC0415

    return [tiles for _, tiles in DECODE_TILES + PREFILL_TILES]


def compile_sm90(kernel, constexprs: dict, pointers: dict, options: dict) -> str:
    """PTX of ``kernel`` compiled by Triton's own ptxas for sm_90 (no GPU needed), with 16-byte
    aligned pointers and integer arguments (as at 120b shapes)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

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
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.parametrize("tiles", _all_regimes(), ids=lambda tiles: f"block_m{tiles.block_m}")
def test_gemms_compile_for_sm90(tiles) -> None:
    """gate_up and down as launched for 120b shapes compile with Triton 3.6 for sm_90, with a
    pipelined K loop (cp.async), tensor-core MMAs and no local memory."""
    from gptoss_serve.kernels import _moe_gemm  # noqa: PLC0415

    pointers = {"x_ptr": "*bf16", "h_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*fp32"}
    pointers |= {"routing_weights_ptr": "*fp32", "blocks_ptr": "*u8", "scales_ptr": "*u8"}
    for kernel, gemm in [
        (_moe_gemm._gate_up_kernel, tiles.gate_up),
        (_moe_gemm._down_kernel, tiles.down),
    ]:
        constexprs = dict(K=2880, BLOCK_M=tiles.block_m, BLOCK_N=gemm.block_n)
        constexprs |= dict(BLOCK_K=gemm.block_k, SWAP_AB=gemm.swap_ab, PTX=True, INTERPRET=False)
        options = dict(num_warps=gemm.num_warps, num_stages=gemm.num_stages)
        ptx = compile_sm90(kernel, constexprs, pointers, options)
        assert "cp.async" in ptx  # the K loop is software-pipelined
        assert ("wgmma" in ptx) or ("mma.sync" in ptx)
        assert ".local" not in ptx  # no stack frame (register arrays indexed at run time)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="compiles for the GPU, not the interpreter")
@pytest.mark.parametrize("variant", range(len(_decode_variants())))
def test_decode_kernels_compile_for_sm90(variant: int) -> None:
    """The decode path's kernels at 120b shapes: weights and activations streamed by cp.async
    into mma.sync, the decode's packed bf16 multiplies, no local memory; griddepcontrol and the
    L2 prefetch with PDL."""
    from gptoss_serve.kernels import _moe_decode  # noqa: PLC0415
    from gptoss_serve.kernels._moe_small import split_plan  # noqa: PLC0415

    tiles = _decode_variants()[variant]
    pointers = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16"}
    pointers |= {"x_thread_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16"}
    pointers |= {"logits_ptr": "*fp32", "routing_weights_ptr": "*fp32"}
    pointers |= {"blocks_ptr": "*u8", "scales_ptr": "*u8"}
    common = dict(TOP_K=4, PTX=tiles.ptx, PDL=tiles.pdl, INTERPRET=False)
    gate_up = dict(H=2880, N=5760, E=128, ROUTED=False, BN=tiles.gate_up_rows * tiles.gate_up_split)
    gate_up |= dict(SPLIT=tiles.gate_up_split, NUM_STAGES=tiles.gate_up_stages)
    down = dict(N=2880, K=2880, E=128, BR=tiles.down_rows, SPLIT=tiles.down_split)
    down |= dict(NUM_STAGES=tiles.down_stages)
    gate_up |= split_plan(2880, tiles.gate_up_split, tiles.gate_up_unroll) | common
    down |= split_plan(2880, tiles.down_split, tiles.down_unroll) | common
    for kernel, constexprs, warps, stages in [
        (_moe_decode._gate_up_kernel, gate_up, tiles.gate_up_warps, tiles.gate_up_stages),
        (_moe_decode._down_kernel, down, tiles.down_warps, tiles.down_stages),
    ]:
        ptx = compile_sm90(kernel, constexprs, pointers, dict(num_warps=warps, num_stages=stages))
        assert "cp.async" in ptx and "mma.sync" in ptx
        assert ".local" not in ptx
        assert ("mul.rn.bf16x2" in ptx) == tiles.ptx
        assert ("griddepcontrol.wait" in ptx) == tiles.pdl
    for num_tokens, block_k in [(1, 4096), (16, 256)]:
        router = dict(H=2880, E=128, T_PAD=num_tokens, BLOCK_E=tiles.router_experts)
        router |= dict(BLOCK_K=tiles.router_block_k or block_k, PDL=tiles.pdl)
        router |= dict(TOP_K=4, ROUTE=not tiles.pdl)  # both variants compile
        ptx = compile_sm90(_moe_decode._router_kernel, router, pointers, dict(num_warps=4))
        assert ".local" not in ptx
