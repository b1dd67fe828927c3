"""Triton launches without Triton's per-call work in Python, for the eager steps.

An eager forward pass (every step with a prefill) issues ~470 Triton launches, and Triton's
``JITFunction.run`` spends ~15 us of host time in each before the launch itself (binding and
specialising every argument, a cache key built from ``str(options)``, the driver's device and
stream, hooks, a check of the globals): 22.6 against 7.9 us for a 15-argument kernel on the
H200 machine's host. That host took 37-50 ms to issue a 120b forward pass whose kernels take
18 ms at 128 tokens, 28 ms at 512 and 38 ms at 1024, so short prefills wait for the host
(bench/prefill_gap.py). Direct launches cut its issue time 5-8% (512 tokens: wall 47.3 ->
42.7 ms, in one process; bench/RESULTS.md e31); the rest is our wrappers and torch's ops.

``launcher(kernel)[grid](*args, **kwargs)`` takes the same arguments as
``kernel[grid](*args, **kwargs)``. The first call of each argument signature goes through
Triton as usual (compiling if need be) and keeps the compiled kernel it returns; later calls
with the same signature launch that kernel directly (``CompiledKernel.run``, the call Triton
itself ends with). The signature is finer than Triton's specialisation, so two calls that
share it always share Triton's compiled kernel too:

- a tensor: its dtype and whether its address is a multiple of 16 (Triton's alignment);
- an int: 1 (Triton makes it a constant), a multiple of 16 (Triton's divisibility), and
  whether it fits 32 bits; a bool or None: its value; a float: only that it is one;
- a constexpr, and everything passed by keyword (constexprs, non-constexpr values, launch
  options): its value (a tensor's as above), in call order.

A call that has anything else (another argument type, a callable grid, Triton's launch hooks
set, the interpreter) goes through Triton. ``set_verification(True)`` (the GPU tests) also
binds every direct launch through Triton's own binder and refuses one whose compiled kernel
differs from Triton's choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Signatures kept per kernel: a keyword value that changes on every call (a stride of a
# varying shape) must not grow the cache without bound; past this, such calls go through
# Triton.
MAX_SIGNATURES = 1024

_launchers: dict[int, FastLauncher] = {}
_verify = False
_enabled = True


def launcher(kernel) -> FastLauncher:
    """The (cached) fast launcher of a ``@triton.jit`` kernel."""
    found = _launchers.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _launchers[id(kernel)] = FastLauncher(kernel)
    return found


def set_verification(enabled: bool) -> None:
    """Check every direct launch against Triton's own binding (slow; for tests)."""
    global _verify  # noqa: PLW0603 (a test switch, read on every launch)
    _verify = enabled


def set_enabled(enabled: bool) -> None:
    """Direct launches on (the default) or off (every call through Triton: A/B runs)."""
    global _enabled  # noqa: PLW0603 (a process-wide switch, read on every launch)
    _enabled = enabled


class SignatureMismatchError(RuntimeError):
    """A direct launch would have run another compiled kernel than Triton picks."""


class FastLauncher:
    def __init__(self, kernel) -> None:
        from triton.runtime.jit import JITFunction  # noqa: PLC0415 (GPU-only dependency)

        self.kernel = kernel
        # Under TRITON_INTERPRET the kernels are InterpretedFunctions: always through Triton.
        self.direct = isinstance(kernel, JITFunction)
        # Triton's runtime knobs, read for its launch hooks on every call (one object, whose
        # hook attributes a profiler sets and clears).
        self.runtime = _runtime_knobs()
        self.names: list[str] = []
        self.defaults: dict[str, Any] = {}
        self.constexprs: tuple[bool, ...] = ()  # per parameter: a constexpr, keyed by value
        if self.direct:
            self.constexprs = tuple(param.is_constexpr for param in kernel.params)
            parameters = kernel.signature.parameters
            self.names = list(parameters)
            self.defaults = {
                name: p.default for name, p in parameters.items() if p.default is not p.empty
            }
        self.compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
        self.direct_launches = 0

    def __getitem__(self, grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict) -> Any:
        key = self._key(grid, args, kwargs)
        if key is None:
            return self.kernel[grid](*args, **kwargs)
        try:
            found = self.compiled.get(key)
        except TypeError:  # an unhashable keyword value, or an argument of another type
            return self.kernel[grid](*args, **kwargs)
        if found is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self.compiled) < MAX_SIGNATURES and _launchable(compiled):
                tail = tuple(self.names[len(args) :])
                self.compiled[key] = (compiled, tail)
                if len(self.compiled) == MAX_SIGNATURES:
                    name = self.kernel.__name__
                    logger.warning("%s: %d launch signatures kept; new ones go through Triton's "
                                   "binding from now on (a keyword value that changes every "
                                   "call?)", name, MAX_SIGNATURES)  # fmt: skip
            return compiled
        compiled, tail = found
        values = [*args]
        for name in tail:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        if _verify:
            self._check(compiled, args, kwargs)
        stream = torch._C._cuda_getCurrentRawStream(key[0])  # key[0]: the current device
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)  # fmt: skip
        self.direct_launches += 1
        return compiled

    def _key(self, grid, args: tuple, kwargs: dict) -> tuple | None:
        """The call's signature (None: through Triton); it may hold an unhashable value."""
        if not (_enabled and self.direct and isinstance(grid, tuple)) or _hooks_set(self.runtime):
            return None
        if len(args) > len(self.constexprs):
            return None
        constexprs = self.constexprs[: len(args)]
        spec = [_spec(value, exact=c) for value, c in zip(args, constexprs, strict=True)]
        spec.extend((name, _spec(value, exact=True)) for name, value in kwargs.items())
        return (torch.cuda.current_device(), *spec)

    def _check(self, compiled, args: tuple, kwargs: dict) -> None:
        """Triton's own choice of compiled kernel for this call (JITFunction.run's binding)."""
        from triton import knobs  # noqa: PLC0415
        from triton.runtime.driver import driver  # noqa: PLC0415
        from triton.runtime.jit import compute_cache_key  # noqa: PLC0415

        options = dict(kwargs)
        options["debug"] = options.get("debug", self.kernel.debug) or knobs.runtime.debug
        options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device = driver.active.get_current_device()
        kernel_cache, key_cache, _, _, binder = self.kernel.device_caches[device]
        _, specialization, bound_options = binder(*args, **options)
        expected = kernel_cache.get(compute_cache_key(key_cache, specialization, bound_options))
        if expected is not compiled:
            name = self.kernel.__name__
            raise SignatureMismatchError(
                f"{name}: a direct launch's signature maps to another kernel than Triton's"
            )


class _Unkeyed:
    """An argument of a type the signature does not describe (unhashable: no direct launch)."""

    __hash__ = None


_UNKEYED = _Unkeyed()


def _spec(value: Any, *, exact: bool = False) -> Any:
    """What of ``value`` the signature keeps (``exact``: a keyword's value, all of it but for
    a tensor)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, bool) or exact:
        return value
    if isinstance(value, int):
        if value == 1:
            return (int, 1)
        return (int, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if isinstance(value, float):
        return float
    return _UNKEYED


def _runtime_knobs():
    from triton import knobs  # noqa: PLC0415 (GPU-only dependency)

    return knobs.runtime


def _hooks_set(runtime) -> bool:
    """Triton's launch hooks (a profiler's): since 3.5 empty HookChains when none is set."""
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _hook_active(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def _launchable(compiled) -> bool:
    """A compiled kernel with the attributes a direct launch uses (not a pending compile)."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))
