"""The MoE tests' GPU weights (test_moe.py, test_moe_decode.py)."""

from __future__ import annotations

import pytest
import torch
from moe_cases import fresh_seed, random_weights

from gptoss_serve.kernels.moe import MoeWeights


@pytest.fixture(scope="module", params=[128, 32], ids=["120b", "20b"])
def gpu_weights(request: pytest.FixtureRequest) -> MoeWeights:
    """120b and 20b expert shapes on the GPU, fresh values for each test module."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true fp32
    return random_weights(request.param, 2880, 2880, device="cuda", seed=fresh_seed())
