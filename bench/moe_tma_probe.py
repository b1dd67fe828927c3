"""Can TMA stream one layer's batch-1 gate_up bytes faster than cp.async? (H200)

moe_persistent_probe.py found that the bytes of the T = 1 gate_up (4 experts x 5,760 rows of
1,440 bytes, ~33 MB a layer) streamed by a Triton loop of cp.async with nothing computed reach
only 2.5-3.0 TB/s in one launch, so no GEMV built that way reaches the 3.3 TB/s target. Here
the same bytes come through the Tensor Memory Accelerator instead: (1) a Gluon kernel with a
1-warp TMA producer and a consumer warp group (warp specialization, an mbarrier ring of
NUM_BUFFERS [BR, 32]-word tiles), one program per BR-row tile or a persistent grid; (2) Triton's
own tensor descriptors (`desc.load` in a pipelined loop). The consumers XOR every word they
receive (read from shared memory into registers, as a GEMV would). 36 layers, one launch per
layer in a CUDA graph, against the cp.async stream of moe_persistent_probe.py.

    cd bench && python3 moe_tma_probe.py [--out results/moe_tma_probe.json]
"""

# Triton's conventions: UPPER_CASE constexpr parameters, kernels with many positional arguments.
# ruff: noqa: N803, N806, PLR0917
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from moe_layout_probe import LAYERS, ROWS, layer_us, parse_args, random_layers, write_rows
from moe_persistent_probe import ROW_BYTES, _stream_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import copy_tbps, graph_time_ms

ROW_WORDS = ROW_BYTES // 4
BOX_WORDS = 32  # 128 bytes: the widest box a 128-byte swizzle takes
STEPS = triton.cdiv(ROW_WORDS, BOX_WORDS)  # the last box is a quarter (TMA fills zeros past K)
# Gluon: (rows per tile, buffers, consumer warps, programs per SM or None: one per tile,
# maxnreg: the register cap that lets that many programs share an SM)
GLUON = [
    (64, 4, 4, None, 64), (64, 8, 4, None, 64), (64, 6, 8, None, 64), (128, 4, 4, None, 64),
    (64, 8, 4, 1, 128), (64, 12, 4, 1, 128), (64, 6, 4, 2, 64), (128, 6, 4, 1, 128),
    (128, 8, 8, 1, 128), (32, 8, 4, 2, 64),
]  # fmt: skip
# Triton descriptors: (rows per tile, stages, warps)
TRITON = [(64, 3, 4), (64, 4, 4), (64, 6, 4), (64, 4, 8), (128, 4, 8), (32, 6, 4)]


@gluon.jit
def _tma_ring(desc, NUM_BUFFERS: gl.constexpr):
    """NUM_BUFFERS shared boxes of ``desc`` and their (ready, empty) mbarriers, initialized."""
    box: gl.constexpr = desc.block_type.shape
    bufs = gl.allocate_shared_memory(desc.dtype, [NUM_BUFFERS, box[0], box[1]], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return bufs, ready, empty


@gluon.jit
def _tma_producer(desc, bufs, ready, empty, num_tiles, BR: gl.constexpr, NUM_STEPS: gl.constexpr):
    """Worker partition (1 warp): one TMA copy per (tile, step) into the ring."""
    NUM_BUFFERS: gl.constexpr = bufs.type.shape[0]
    BKW: gl.constexpr = desc.block_type.shape[1]
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        for step in range(NUM_STEPS):
            slot = i % NUM_BUFFERS
            mbarrier.wait(empty.index(slot), (i // NUM_BUFFERS & 1) ^ 1)  # fresh: passes
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                desc, [tile * BR, step * BKW], ready.index(slot), bufs.index(slot)
            )
            i += 1


@gluon.jit
def _xor_consumer(bufs, ready, empty, out_ptr, num_tiles, BR: gl.constexpr,
                  NUM_STEPS: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Default partition: XOR each tile's words as they land; one int per row."""
    NUM_BUFFERS: gl.constexpr = bufs.type.shape[0]
    BKW: gl.constexpr = bufs.type.shape[2]
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros([BR, BKW], gl.int32, layout)
        for _ in range(NUM_STEPS):
            slot = i % NUM_BUFFERS
            mbarrier.wait(ready.index(slot), i // NUM_BUFFERS & 1)
            acc ^= bufs.index(slot).load(layout)
            fence_async_shared()  # the shared load before the slot's next TMA write
            mbarrier.arrive(empty.index(slot), count=1)
            i += 1
        rows = tile * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
        gl.store(out_ptr + rows, gl.xor_sum(acc, axis=1).to(gl.float32))


@gluon.jit
def _gluon_stream_kernel(desc, out_ptr, num_tiles, BR: gl.constexpr, NUM_STEPS: gl.constexpr,
                         NUM_BUFFERS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    BKW: gl.constexpr = desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BKW, BKW // 4], [num_warps, 1],
                                            [1, 0])  # fmt: skip
    bufs, ready, empty = _tma_ring(desc, NUM_BUFFERS)
    gl.warp_specialize(
        [
            (_xor_consumer, (bufs, ready, empty, out_ptr, num_tiles, BR, NUM_STEPS, layout)),
            (_tma_producer, (desc, bufs, ready, empty, num_tiles, BR, NUM_STEPS)),
        ],
        [1],
        [24],
    )


@triton.jit
def _triton_tma_kernel(desc, out_ptr, BR: tl.constexpr, BKW: tl.constexpr,
                       NUM_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    r0 = tl.program_id(0) * BR
    acc = tl.zeros([BR, BKW], tl.int32)
    for step in tl.range(0, NUM_STEPS, num_stages=NUM_STAGES):
        acc ^= desc.load([r0, step * BKW])
    tl.store(out_ptr + r0 + tl.arange(0, BR), tl.xor_sum(acc, axis=1).to(tl.float32))


def gluon_descriptor(words: torch.Tensor, br: int) -> GluonDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([br, BOX_WORDS], gl.int32)
    return GluonDescriptor(words, list(words.shape), list(words.stride()), [br, BOX_WORDS], layout)


def row_xor(words: torch.Tensor) -> torch.Tensor:
    """What every kernel must store: the XOR of each row's words, as float32."""
    acc = words[:, 0].clone()
    for w in range(1, words.shape[1]):
        acc ^= words[:, w]
    return acc.to(torch.float32)


def main() -> int:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, _ = random_layers(ROW_BYTES, 1)
    words = [blocks[layer].view(torch.int32).view(ROWS, ROW_WORDS) for layer in range(LAYERS)]
    expected = row_xor(words[-1])
    layer_bytes = ROWS * ROW_BYTES
    results = [{"config": "copy (SM kernel)", "tbps": round(copy_tbps(), 3)}]
    out = torch.empty(ROWS, device="cuda")
    runs = []
    for br, buffers, warps, per_sm, maxnreg in GLUON:
        descs = [gluon_descriptor(w, br) for w in words]
        grid = ROWS // br if per_sm is None else per_sm * sms

        def launch(descs=descs, grid=grid, br=br, buffers=buffers, warps=warps,
                   maxnreg=maxnreg) -> None:  # fmt: skip
            for desc in descs:
                _gluon_stream_kernel[(grid,)](
                    desc, out, ROWS // br, BR=br, NUM_STEPS=STEPS, NUM_BUFFERS=buffers,
                    num_warps=warps, maxnreg=maxnreg,
                )  # fmt: skip

        runs.append((f"gluon ws {br} rows {buffers} buf {warps} warps grid {grid}", launch))
    for br, stages, warps in TRITON:
        descs = [TensorDescriptor.from_tensor(w, [br, BOX_WORDS]) for w in words]

        def launch(descs=descs, br=br, stages=stages, warps=warps) -> None:
            for desc in descs:
                _triton_tma_kernel[(ROWS // br,)](
                    desc, out, BR=br, BKW=BOX_WORDS, NUM_STEPS=STEPS, NUM_STAGES=stages,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip

        runs.append((f"triton desc {br} rows {stages} st {warps} warps", launch))
    sys.stdout.write(f"{'kernel':<48} {'us/layer':>9} {'TB/s':>7} {'out':>5}\n")
    for name, launch in runs:
        out.fill_(float("nan"))
        us = layer_us(name, launch)
        if us is None:
            continue
        ok = "ok" if torch.equal(out, expected) else "WRONG"
        tbps = layer_bytes / (us * 1e-6) / 1e12
        sys.stdout.write(f"{name:<48} {us:9.2f} {tbps:7.3f} {ok:>5}\n")
        results.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3), "out": ok})

    def cp_async(per_program=64, words_per_step=16, warps=8, stages=4) -> None:
        for layer in range(LAYERS):
            _stream_kernel[(ROWS // per_program,)](
                blocks[layer], out, ROWS_PER_PROGRAM=per_program, WORDS=words_per_step,
                NUM_STAGES=stages, num_warps=warps, num_stages=stages,
            )  # fmt: skip

    us = statistics.median(graph_time_ms(cp_async, calls=LAYERS, repeats=20)) * 1e3
    tbps = ROWS * 1408 / (us * 1e-6) / 1e12  # whole 64-byte steps only: 1,408 bytes a row
    name = "cp.async stream 64 rows 8 warps 4 st (probe v9)"
    sys.stdout.write(f"{name:<48} {us:9.2f} {tbps:7.3f}\n")
    results.append({"config": name, "us": round(us, 2), "tbps": round(tbps, 3)})
    sys.stdout.write(f"copy: {results[0]['tbps']} TB/s\n")
    return write_rows(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
