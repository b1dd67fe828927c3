"""A warp-specialized batch-1 MXFP4 GEMV in Gluon against the Triton one (H200)

The decode gate_up at T = 1 (one program per 64-row tile, a cp.async pipeline, 4 warps) spends
5.8 cycles per issued instruction, a quarter of them waiting on loads and barriers (ncu,
bench/RESULTS.md v10). Here the same rows go through a Gluon kernel whose loads come from a
1-warp TMA producer into an mbarrier ring, so the 4 decoding warps only wait when the ring is
empty: each thread takes word t (lane t of 4) of every 32-element group of its two rows,
decodes it with the same PTX (_moe_gemv._DECODE_PTX) straight into mma.sync's A fragment
(k_width 2: the two nibbles 16 bits apart are one bf16x2 register), against x stored in the
matching "virtual" order (``virtual_order``). 36 layers of 4 experts' gate_up rows, one launch
per layer in a CUDA graph, against _real_k_kernel (moe_layout_probe.py) on the same bytes;
both checked against the dequantized rows times x in fp32 (the last layer).

    cd bench && python3 moe_gluon_probe.py [--out results/moe_gluon_probe.json]
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import sys

import torch
import triton
from moe_layout_probe import (
    LAYERS,
    ROWS,
    layer_us,
    parse_args,
    random_layers,
    real_k_launcher,
    write_rows,
)
from moe_tma_probe import _tma_ring
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gptoss_serve.kernels._moe_gemv import _DECODE_PTX
from gptoss_serve.kernels._moe_small import thread_order
from gptoss_serve.kernels.mxfp4 import dequantize_mxfp4
from kernels import copy_tbps

K = 2880
ROW_BYTES, ROW_SCALES = K // 2, K // 32
STEP_WORDS = 32  # one TMA box row: 128 bytes = 8 groups = 256 columns
STEPS = triton.cdiv(ROW_BYTES // 4, STEP_WORDS)  # 12; TMA reads zeros past the row's end
# (rows per program, ring buffers, maxnreg)
CONFIGS = [(64, 4, 128), (64, 8, 128), (64, 4, 80), (64, 6, 80), (64, 8, 96)]
TRITON = [(128, 2, 4, 3), (128, 2, 4, 4)]  # the T = 1 gate_up row: 64 rows x split 2


def virtual_order(x: torch.Tensor) -> torch.Tensor:
    """x [K] -> [STEPS · 256] (zeros past K) in the kernel's column order: within each 32,
    position 16·a1 + 8·a0 + 2t + h holds element 8t + 2·a1 + a0 + 4h (word t of the group,
    its nibble pair a = 2·a1 + a0, half h)."""
    padded = torch.zeros(STEPS * 256, dtype=x.dtype, device=x.device)
    padded[:K] = x
    groups = padded.view(-1, 4, 2, 2, 2)  # [group, t, h, a1, a0]: k = 8t + 4h + 2a1 + a0
    return groups.permute(0, 3, 4, 1, 2).reshape(-1).contiguous()  # [group, a1, a0, t, h]


@gluon.jit
def _decode_words(words, mult):
    """int32 words [..., W] and their bf16x2 multipliers (_moe_gemv._DECODE_PTX) -> bf16
    [..., W, 2 h, 2 a0, 2 a1]: nibble a + 4h of each word, a = 2·a1 + a0, in its layout."""
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        _DECODE_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, mult],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
    )  # fmt: skip
    return gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)),
                   gl.join(gl.join(o4, o5), gl.join(o6, o7)))  # fmt: skip


@gluon.jit
def _producer(desc, bufs, ready, empty, NUM_STEPS: gl.constexpr):
    """1 warp: the program's rows, one [BR, 32]-word box per step, into the ring."""
    NUM_BUFFERS: gl.constexpr = bufs.type.shape[0]
    BR: gl.constexpr = desc.block_type.shape[0]
    BKW: gl.constexpr = desc.block_type.shape[1]
    row0 = gl.program_id(0) * BR
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        mbarrier.wait(empty.index(slot), (step // NUM_BUFFERS & 1) ^ 1)
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row0, step * BKW], ready.index(slot),
                                        bufs.index(slot))  # fmt: skip


@gluon.jit
def _consumer(bufs, ready, empty, xv_ptr, scales_ptr, out_ptr, NUM_STEPS: gl.constexpr,
              words_layout: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr,
              mma_layout: gl.constexpr):  # fmt: skip
    NUM_BUFFERS: gl.constexpr = bufs.type.shape[0]
    BR: gl.constexpr = bufs.type.shape[1]
    BKW: gl.constexpr = bufs.type.shape[2]
    row0 = gl.program_id(0) * BR
    rows = row0 + gl.arange(0, BR, layout=gl.SliceLayout(1, words_layout))
    words_idx = gl.arange(0, BKW, layout=gl.SliceLayout(0, words_layout))
    # scale of (row, group 8·step + word // 4): byte offsets, 8 groups a step
    scale_ptrs = scales_ptr + rows.to(gl.int64)[:, None] * 90 + (words_idx // 4)[None, :]
    vk = gl.arange(0, 256, layout=gl.SliceLayout(1, b_layout))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, b_layout))
    x_ptrs = xv_ptr + vk[:, None] + 0 * cols[None, :]  # every column holds x
    acc = gl.zeros([BR, 8], gl.float32, mma_layout)
    group = (words_idx // 4)[None, :] + 0 * rows[:, None]
    scale = gl.load(scale_ptrs, mask=group < 90, other=0).to(gl.int32)
    for step in range(NUM_STEPS):
        slot = step % NUM_BUFFERS
        next_groups = group + 8 * (step + 1)
        next_scale = gl.load(scale_ptrs + 8 * (step + 1), mask=next_groups < 90, other=0)
        x = gl.load(x_ptrs + 256 * step)
        mbarrier.wait(ready.index(slot), step // NUM_BUFFERS & 1)
        words = bufs.index(slot).load(words_layout)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        # [BR, 32 words, h, a0, a1]: word 4c + t, nibble pair a = 2·a1 + a0, half h
        tile = _decode_words(words, (scale + 64) * 0x00800080)
        tile = gl.reshape(tile, [BR, 8, 4, 2, 2, 2])  # m c t h a0 a1
        tile = gl.permute(tile, (0, 1, 5, 4, 2, 3))  # m c a1 a0 t h
        a = gl.convert_layout(gl.reshape(tile, [BR, 256]), a_layout, assert_trivial=True)
        acc = mma_v2(a, x, acc)
        scale = next_scale.to(gl.int32)
    keep = gl.arange(0, 8, layout=gl.SliceLayout(0, mma_layout))[None, :] == 0
    y = gl.sum(gl.where(keep, acc, 0.0), axis=1) * 4.611686018427388e18  # 2^62
    out_rows = row0 + gl.arange(0, BR, layout=gl.SliceLayout(1, mma_layout))
    gl.store(out_ptr + out_rows, y)


@gluon.jit
def _gluon_gemv_kernel(desc, xv_ptr, scales_ptr, out_ptr, NUM_STEPS: gl.constexpr,
                       NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """out[row] = 2^62 · (rows of W) @ x for the program's BR rows (4 consumer warps)."""
    BR: gl.constexpr = desc.block_type.shape[0]
    BKW: gl.constexpr = desc.block_type.shape[1]
    gl.static_assert(BR == 64)
    gl.static_assert(BKW == 32)
    # thread (warp w, lane 4g + t): word 4c + t (c = 0..7) of rows 16w + g and 16w + g + 8
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 8], [0, 16], [8, 0]],
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BR, BKW],
    )  # fmt: skip
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    bufs, ready, empty = _tma_ring(desc, NUM_BUFFERS)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    bufs,
                    ready,
                    empty,
                    xv_ptr,
                    scales_ptr,
                    out_ptr,
                    NUM_STEPS,
                    words_layout,
                    a_layout,
                    b_layout,
                    mma_layout,
                ),
            ),
            (_producer, (desc, bufs, ready, empty, NUM_STEPS)),
        ],
        [1],
        [24],
    )


def descriptor(words: torch.Tensor, br: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([br, STEP_WORDS], gl.int32)  # 128 B swizzle
    return TensorDescriptor(words, list(words.shape), list(words.stride()), [br, STEP_WORDS],
                            layout)  # fmt: skip


def main() -> int:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    blocks, scales = random_layers(ROW_BYTES, ROW_SCALES)
    x = torch.randn(K, device="cuda").to(torch.bfloat16)
    xv = virtual_order(x)
    x_thread = thread_order(x[None])[0].contiguous()  # _real_k_kernel's order
    weights = dequantize_mxfp4(blocks[-1].view(ROWS, -1, 16), scales[-1].view(ROWS, -1),
                               torch.float32)  # fmt: skip
    reference = weights @ x.float()  # the last layer's rows, what every kernel must give
    del weights
    out = torch.empty(ROWS, device="cuda")
    layer_bytes = ROWS * (ROW_BYTES + ROW_SCALES)
    results = [{"config": "copy (SM kernel)", "tbps": round(copy_tbps(), 3)}]
    runs = []
    for bn, split, warps, stages in TRITON:
        launch = real_k_launcher(x_thread, blocks, scales, out, ROWS, bn, split, warps, stages)
        runs.append((f"triton {bn} rows split {split} {warps} warps {stages} st", launch, 2.0**62))
    for br, buffers, maxnreg in CONFIGS:
        descs = [descriptor(blocks[layer].view(torch.int32).view(ROWS, -1), br)
                 for layer in range(LAYERS)]  # fmt: skip

        def launch(descs=descs, br=br, buffers=buffers, maxnreg=maxnreg) -> None:
            for layer in range(LAYERS):
                _gluon_gemv_kernel[(ROWS // br,)](
                    descs[layer], xv, scales[layer], out, NUM_STEPS=STEPS,
                    NUM_BUFFERS=buffers, num_warps=4, maxnreg=maxnreg,
                )  # fmt: skip

        runs.append((f"gluon ws {br} rows {buffers} buf maxnreg {maxnreg}", launch, 1.0))
    sys.stdout.write(f"{'kernel':<44} {'us/layer':>9} {'TB/s':>7} {'max_rel':>8}\n")
    for name, launch, out_scale in runs:
        out.fill_(float("nan"))
        us = layer_us(name, launch)
        if us is None:
            continue
        err = ((out * out_scale - reference).abs().max() / reference.abs().max()).item()
        tbps = layer_bytes / (us * 1e-6) / 1e12
        sys.stdout.write(f"{name:<44} {us:9.2f} {tbps:7.3f} {err:8.1e}\n")
        results.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3),
                        "max_rel": err})  # fmt: skip
    sys.stdout.write(f"copy: {results[0]['tbps']} TB/s\n")
    return write_rows(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
