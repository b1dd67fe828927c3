"""The fused MXFP4 MoE: the plain-torch reference (CPU), the Triton path under the interpreter
(small ragged shapes) and on the GPU (120b/20b shapes), all through compare.assert_close.
The decode path (T ≤ DECODE_MAX_TOKENS) has its own file, test_moe_decode.py; the helpers
both use, and the reasoning behind the tolerance, are in moe_cases.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from compare import assert_close
from moe_cases import (
    INTERPRETING,
    MAX_REL,
    RMS_REL,
    assert_same_routing,
    check_against_reference,
    clear_tokens,
    compile_sm90,
    fresh_seed,
    interpreter,
    random_weights,
    random_x,
    reference_routing,
)

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.moe import (
    CHECKPOINT_TENSORS,
    MoeWeights,
    moe,
    mxfp4_moe,
    mxfp4_moe_bytes,
    mxfp4_moe_flops,
    mxfp4_moe_reference,
)
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from gptoss_serve.model.layers import MLP

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


def check_routing(x: torch.Tensor, weights: MoeWeights, tiles) -> None:
    """Top-4 ids equal torch.topk's on fp32 logits, weights agree, grouping is consistent."""
    from gptoss_serve.kernels._moe_triton import route_triton  # noqa: PLC0415

    expert_ids, routing_weights, grouping = route_triton(x, weights, top_k=4, tiles=tiles)
    expected_ids, expected_weights = reference_routing(x, weights)
    clear = clear_tokens(x, weights)
    assert_same_routing(expert_ids[clear], routing_weights[clear], expected_ids[clear],
                        expected_weights[clear])  # fmt: skip
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


# -- the Triton path under the interpreter (CPU tensors) ---------------------------------------


def _regimes() -> list:
    if not INTERPRETING:
        return [None]
    from gptoss_serve.kernels._moe_triton import PREFILL_TILES, SMALL_BATCH_TILES  # noqa: PLC0415

    return [SMALL_BATCH_TILES[0][1], PREFILL_TILES[0][1]]  # one-program routing; atomic grouping


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


# -- the GEMMs compile for Hopper (Triton's own ptxas; no GPU needed) ----------------------------


def _all_regimes() -> list:
    if importlib.util.find_spec("triton") is None:
        return []
    from gptoss_serve.kernels._moe_triton import PREFILL_TILES, SMALL_BATCH_TILES  # noqa: PLC0415

    return [tiles for _, tiles in SMALL_BATCH_TILES + PREFILL_TILES]


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
