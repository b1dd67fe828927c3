"""What ptxas makes of the grouped-columns MoE kernels, without a GPU: registers, spills, its
performance advisories, and how the tensor-core instructions wait.

    python bench/sass_check.py [--tokens 64 512 2048 8192]

Needs Triton (any machine: it compiles for sm_90a through Triton's bundled ptxas; the CPU
venv of `make test` has no Triton, so `pip install triton==3.6.0` beside it). For each token
count it compiles ``_columns_gate_up_kernel`` and ``_columns_down_kernel`` with that count's
row of ``decode_tiles_for`` and the engine's weight layout (bands of 16 rows, permuted words:
mxfp4_layout.STEP_ROWS), as ``launch_columns`` would, and prints one line per kernel:

- registers a thread, spill bytes (ptxas -v; the prefill down kernels' few spills sit before
  and after the main loop, values kept for the epilogue);
- ptxas's "Potential Performance Loss" advisories (C7510-C7515: wgmmas serialized, e.g.
  C7513 when a wgmma's register operand is written while another is in flight);
- HGMMA (wgmma) and HMMA (mma.sync) counts in the SASS, and how many ``WARPGROUP.DEPBAR.LE
  gsb0, 0x0`` (waits for every wgmma in flight) there are.

RESULTS v23 found with this that the warp-specialized Gluon probe's one-group-a-wait consumer
was serialized by ptxas (C7513), while the engine's Triton kernel issues 8 wgmmas a wait.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gptoss_serve.kernels import _moe_columns as columns
from gptoss_serve.kernels import _moe_small as small
from gptoss_serve.kernels import mxfp4_layout

HIDDEN = INTER = 2880  # 120b (and 20b) hidden and intermediate sizes
TOP_K = 4
_POINTERS = {
    "x_thread_ptr": "*bf16", "h_ptr": "*bf16", "group_expert_ptr": "*i32",
    "group_pairs_ptr": "*i32", "blocks_ptr": "*u8", "scales_ptr": "*u8", "bias_ptr": "*bf16",
    "routing_weights_ptr": "*fp32", "y_ptr": "*bf16",
}  # fmt: skip
_SCALARS = {"alpha": "fp32", "limit": "fp32", "stride_y": "i32"}


def _compile(kernel, constants: dict, num_warps: int, num_stages: int) -> str:
    """PTX of ``kernel`` (a triton.jit function) for sm_90a with ``constants``."""
    names = list(inspect.signature(kernel.fn).parameters)
    types = _POINTERS | _SCALARS
    signature = {name: types.get(name, "constexpr") for name in names}
    unknown = [n for n in names if signature[n] == "constexpr" and n not in constants]
    if unknown:
        raise ValueError(f"no value for {unknown} of {kernel.fn.__name__}")
    constexprs = {(names.index(k),): v for k, v in constants.items() if k in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in _POINTERS}
    source = ASTSource(kernel, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"]


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends/nvidia/bin" / name)


def ptxas_report(ptx: str) -> dict:
    """ptxas -v on ``ptx`` for sm_90a: registers, spills, advisories, tensor-core counts."""
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        source.write_text(ptx)
        command = [_tool("ptxas"), "-arch=sm_90a", "-v", str(source), "-o", str(cubin)]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        "advisories": sorted(set(re.findall(r"\((C75\d\d)\) Potential Performance Loss", log))),
        "hgmma": sass.count("HGMMA."),
        "hmma": sass.count("HMMA."),
        "full_waits": sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    }


def column_kernels(tokens: int) -> dict[str, str]:
    """PTX of the gate_up and down kernels as ``launch_columns`` compiles them for ``tokens``."""
    tiles = small.decode_tiles_for(tokens)
    if not tiles.group_columns:
        raise ValueError(f"{tokens} tokens take the per-pair GEMVs, not the grouped columns")
    whole = tiles.tile_order  # the engine's bands are padded to whole steps
    width = small.row_width(HIDDEN, tiles.tile_order)
    common = dict(
        TOP_K=TOP_K, COLS=tiles.group_size, PTX=True, PDL=True, INTERPRET=False,
        TILE_ORDER=tiles.order, SCALE_WORDS=tiles.scale_words, EXTRA=tiles.next_group_columns,
        LB=mxfp4_layout.STEP_ROWS, H_STRIDE=small.row_width(INTER, tiles.tile_order),
    )  # fmt: skip
    gate_up = _compile(columns._columns_gate_up_kernel, common | dict(
        H=HIDDEN, N=2 * INTER, BN=tiles.gate_up_rows, NUM_STAGES=tiles.gate_up_stages,
        X_STRIDE=width,
        **small._full_steps(HIDDEN, whole=whole),
    ), tiles.gate_up_warps, tiles.gate_up_stages)  # fmt: skip
    down = _compile(columns._columns_down_kernel, common | dict(
        N=HIDDEN, K=INTER, BN=tiles.down_rows, NUM_STAGES=tiles.down_stages,
        **small._full_steps(INTER, whole=whole),
    ), tiles.down_warps, tiles.down_stages)  # fmt: skip
    return {"gate_up": gate_up, "down": down}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048, 8192])
    args = parser.parse_args()
    out = sys.stdout
    out.write(f"{'tokens':>6} {'kernel':8} {'regs':>5} {'spill B':>7} {'HGMMA':>6} {'HMMA':>5} "
              f"{'full waits':>10}  ptxas advisories\n")  # fmt: skip
    for tokens in args.tokens:
        for name, ptx in column_kernels(tokens).items():
            r = ptxas_report(ptx)
            out.write(f"{tokens:>6} {name:8} {r['registers']:>5} {r['spill_bytes']:>7} "
                      f"{r['hgmma']:>6} {r['hmma']:>5} {r['full_waits']:>10}  "
                      f"{', '.join(r['advisories']) or '-'}\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
