"""The CUDA caching allocator's settings for an engine process, chosen before CUDA starts.

Loading lays every layer's MoE blocks out anew for the kernels (``MoeWeights.for_kernels``): a
checkpoint-order copy arrives, the kernels' copy is made, and the first is freed. With the
allocator's default fixed-size segments those holes stay reserved between the tensors that
live on, and the KV cache is sized from what the process reserves: after gpt-oss-120b's
weights an H100 held 3.3 GB of holes (70.02 GB reserved for 66.69 GB of tensors), so the
KV cache got 99,568 tokens. With expandable segments the allocator maps physical memory in
2 MiB pages and ``torch.cuda.empty_cache()`` (``WeightsBuilder.finish``) unmaps every free
page, holes included: 67.08 GB reserved, 174,128 KV tokens, max throughput 2,232 -> 3,167
tok/s (48 -> 84 sequences), the decode and prefill figures even (bench/RESULTS.md e24).

The variable is read when CUDA's allocator starts, so ``configure_allocator`` runs first thing
in the CLI (``cli.main``); the fit check's second process inherits the variable. A setting the
user made in either of torch's variables is kept as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

import torch

logger = logging.getLogger(__name__)

# torch reads PYTORCH_ALLOC_CONF first (from 2.9) and PYTORCH_CUDA_ALLOC_CONF otherwise; the
# second is the one every torch this project runs on (2.11 on the GPU machine) understands.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
ENGINE_ALLOC_CONF = "expandable_segments:True"


def configure_allocator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Expandable segments for this process (and its children) unless the environment already
    configures the allocator. Returns the setting in force (None: the allocator had started
    before, so nothing could be set: a warning says what that costs)."""
    environ = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        if name in environ:
            logger.info("CUDA allocator: %s=%s (from the environment)", name, environ[name])
            return environ[name]
    if torch.cuda.is_initialized():
        logger.warning(
            "CUDA started before the allocator was configured: loading's freed copies stay "
            "reserved and the KV cache is sized without them (set %s=%s to avoid it)",
            ALLOC_CONF_VARS[1], ENGINE_ALLOC_CONF,
        )  # fmt: skip
        return None
    environ[ALLOC_CONF_VARS[1]] = ENGINE_ALLOC_CONF
    return ENGINE_ALLOC_CONF
