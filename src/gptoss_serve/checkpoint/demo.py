"""The built-in demo model: a tiny random-weight gpt-oss with the real Harmony vocabulary.

It is written once into a cache directory (the caller passes it; cli.py uses the XDG cache)
and loaded through the same loader as real weights, so ``--model demo`` exercises the whole
product. Its text is gibberish by design: the weights are random.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from gptoss_serve.checkpoint.loader import SINGLE_FILE
from gptoss_serve.checkpoint.synthetic import make_checkpoint

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"
# Bump when the demo's shape or generator changes, so stale caches are not reused.
DEMO_VERSION = 1
DEMO_SEED = 20250805  # gpt-oss release date


def demo_checkpoint_dir(cache_dir: Path) -> Path:
    """Return the demo checkpoint directory under ``cache_dir``, writing it on first use."""
    target = cache_dir / "gptoss-serve" / f"demo-v{DEMO_VERSION}"
    if (target / "config.json").exists() and (target / SINGLE_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing the demo checkpoint to %s (first use)", target)
    # Written into a sibling temp dir and renamed, so a crash never leaves half a checkpoint
    # and two processes racing on first use both end with a complete one.
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        make_checkpoint(staging, "tiny", seed=DEMO_SEED)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / SINGLE_FILE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """``demo`` -> the cached demo checkpoint; anything else is a checkpoint directory."""
    if model == DEMO_MODEL:
        return demo_checkpoint_dir(cache_dir)
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model!r}: not a directory (or 'demo')")
    return path
