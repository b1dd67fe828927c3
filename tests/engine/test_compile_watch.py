"""The warning for Triton kernel variants compiled after the start-up warm-up."""

from __future__ import annotations

import logging

import pytest

from gptoss_serve.engine import compile_watch


def test_a_late_compile_is_a_warning_naming_the_variant(caplog: pytest.LogCaptureFixture) -> None:
    triton = pytest.importorskip("triton")
    before = triton.knobs.runtime.jit_cache_hook
    try:
        compile_watch.watch_late_compiles()
        hook = triton.knobs.runtime.jit_cache_hook
        with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
            skip = hook(
                key="k", repr="_group_kernel[num_warps=8](num_pairs: i32)", fn=object(),
                compile={}, is_manual_warmup=False, already_compiled=False,
            )  # fmt: skip
    finally:
        triton.knobs.runtime.jit_cache_hook = before
    assert not skip  # a truthy answer would make Triton skip the compile
    assert "_group_kernel[num_warps=8](num_pairs: i32)" in caplog.text
    assert "after the warm-up" in caplog.text
