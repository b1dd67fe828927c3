"""Launches only, for Nsight Compute: ``mxfp4_moe`` three times on T random tokens of one random
120b layer (the path the engine takes at T), so ncu can pick one launch of a kernel.

    cd bench && ncu --clock-control none --kernel-name _columns_gate_up_kernel --launch-skip 2 \\
        --launch-count 1 --section SpeedOfLight --section Occupancy python3 ncu_moe.py 2048
"""

from __future__ import annotations

import os
import sys

import torch
from gpu_model import _normal, random_moe_weights

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig
from gptoss_serve.kernels.moe import mxfp4_moe


def main() -> int:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    config = ModelConfig.from_dict(preset_config("120b"))
    weights = random_moe_weights(config)
    x = _normal((tokens, config.hidden_size), 1.0, "cuda")
    for _ in range(3):
        mxfp4_moe(x, weights)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
