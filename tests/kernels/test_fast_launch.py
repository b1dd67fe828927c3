"""kernels/fast_launch.py: what the signature keeps of each argument (CPU), and direct launches
that match Triton's own compiled kernel and results, call after call (GPU)."""

from __future__ import annotations

import pytest
import torch

from gptoss_serve.kernels.fast_launch import _spec

try:  # CPU installs may have no triton at all
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _scaled_add(x, y, out, n, scale, SHIFT: tl.constexpr, BLOCK: tl.constexpr = 128):  # noqa: N803, PLR0917
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(x + offsets, mask=mask)
        b = tl.load(y + offsets, mask=mask)
        tl.store(out + offsets, a * scale + b + SHIFT, mask=mask)


def test_a_tensor_is_kept_as_its_dtype_and_alignment():
    data = torch.zeros(64, dtype=torch.float32)
    assert _spec(data) == (torch.float32, True)
    assert _spec(data[1:]) == (torch.float32, False)  # 4 bytes past an aligned start
    assert _spec(data[4:]) == (torch.float32, True)
    assert _spec(data.to(torch.bfloat16)) != _spec(data)
    assert _spec(data, exact=True) == _spec(data)  # by keyword: still not by identity


def test_an_int_is_kept_as_triton_specialises_it():
    assert _spec(1) == (int, 1)  # Triton makes it a constant
    assert _spec(32) == _spec(48) != _spec(33)  # divisibility by 16
    assert _spec(17) == _spec(33)
    assert _spec(2**31 + 16) != _spec(16)  # 64 bits
    assert _spec(7, exact=True) == 7  # a constexpr or a keyword: its value


def test_bools_none_floats_and_other_types():
    assert _spec(True) is True and _spec(False) is False and _spec(None) is None
    assert _spec(0.5) is float and _spec(2.0) is float
    assert _spec(0.5, exact=True) == 0.5
    with pytest.raises(TypeError):
        hash(_spec("text"))  # another type: no signature, the call goes through Triton
    with pytest.raises(TypeError):
        hash(_spec([1, 2]))


@pytest.mark.gpu
def test_direct_launches_match_triton_call_after_call():
    from gptoss_serve.kernels import fast_launch  # noqa: PLC0415

    launch = fast_launch.launcher(_scaled_add)
    assert fast_launch.launcher(_scaled_add) is launch
    fast_launch.set_verification(True)
    base = torch.randn(1024, device="cuda")
    other = torch.randn(1024, device="cuda")
    cases = [  # (x offset, n, scale, shift, block): alignments, ints 1 / 16k / other, constexprs
        (0, 1000, 0.5, 0, 128), (0, 1000, 2.0, 0, 128), (1, 999, 0.5, 0, 128), (0, 1, 1.5, 0, 128),
        (0, 512, 0.5, 3, 128), (0, 512, 0.5, 3, 256), (2, 640, -1.0, 1, 64),
    ]  # fmt: skip
    for _ in range(3):  # first calls through Triton, then direct
        for offset, n, scale, shift, block in cases:
            x = base[offset : offset + n]
            out = torch.full((n,), float("nan"), device="cuda")
            grid = (triton.cdiv(n, block),)
            if block == 128:
                launch[grid](x, other, out, n, scale, shift)
            else:
                launch[grid](x, other, out, n, scale, SHIFT=shift, BLOCK=block)
            expected = x * scale + other[:n] + shift
            torch.testing.assert_close(out, expected)  # fp32, an FMA's rounding apart
    # Calls of one signature share it (the two scales of the first case), and every call after
    # the first round went direct.
    assert len(launch.compiled) < len(cases)
    assert launch.direct_launches >= 2 * len(cases) + 1


def test_only_a_hook_chain_with_hooks_in_it_counts_as_set():
    from gptoss_serve.kernels.fast_launch import _hook_active  # noqa: PLC0415

    class Chain:
        def __init__(self, calls: list) -> None:
            self.calls = calls

    assert not _hook_active(None)
    assert not _hook_active(Chain([]))  # Triton 3.5+: an empty HookChain by default
    assert _hook_active(Chain([print]))
    assert _hook_active(print)  # an older Triton's plain callable
