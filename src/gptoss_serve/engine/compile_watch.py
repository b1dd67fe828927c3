"""A warning for every Triton kernel variant first compiled (or loaded) after the warm-up.

Triton compiles a kernel per set of constexprs and per specialisation of its arguments
(integers divisible by 16 or equal to 1, pointer alignment). The start-up warm-up
(startup.warm_up) runs the step shapes serving meets so that those compiles happen before
the first request; a variant it missed costs the request that meets it seconds of TTFT.
After the warm-up this hook names each such variant in the log, so a gap in the warm-up shows
(it does not stop the compile).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def watch_late_compiles() -> None:
    """From now on, log a warning naming each kernel variant this process has not run yet."""
    import triton  # noqa: PLC0415 (GPU engines only)

    triton.knobs.runtime.jit_cache_hook = _warn_late_compile


def _warn_late_compile(*, repr: str, **_: Any) -> None:
    """Triton's jit_cache_hook: called on a miss of the process's kernel cache, before the
    compile (or the load from the on-disk cache), with ``repr`` the kernel's name, launch
    options and argument types as specialised. Returns None: the compile goes on."""
    logger.warning("Triton kernel compiled after the warm-up (a request waits for it): %s", repr)
