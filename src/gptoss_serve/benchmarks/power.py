"""The GPU board's power state over a timed stretch of a benchmark, read through NVML
(nvidia-ml-py, ``import pynvml``).

From 8 decode sequences on, and through its prefills, the H200 runs gpt-oss-120b at its 700 W
software power cap and lowers its SM clock (to 1,440-1,830 MHz at 64 sequences; bench/RESULTS.md
e35, e36), so the same code's figures move by several percent with the card's power state. Each
figure then carries the state it ran in: the SM clock's mean and minimum, the mean power, the
share of samples under the power cap, the GPU's temperature (at one power cap a hotter chip
leaks more and clocks lower), and the energy by NVML's counter.

    meter = power_meter(device)      # None off CUDA, or where NVML is missing or fails
    with meter or contextlib.nullcontext():
        ...GPU work, synchronized before the block ends...
    reading = meter.reading() if meter else None

A meter may be entered several times (a figure timed over several trials, each with set-up
between them that is not the figure's): its reading sums the stretches inside.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from types import TracebackType

import torch

logger = logging.getLogger(__name__)

SAMPLE_S = 0.02  # the sampler's period: light on the GIL the engine's host needs
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def nvml_target(ordinal: int, visible: str | None) -> int | str:
    """The NVML index (int) or UUID (str) of CUDA device ``ordinal`` under CUDA_VISIBLE_DEVICES
    ``visible`` (None or empty: every device, in NVML's order)."""
    if not visible:
        return ordinal
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if ordinal >= len(entries):
        raise ValueError(f"CUDA device {ordinal} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[ordinal]
    return int(entry) if entry.isdigit() else entry


def summarize(
    clocks_mhz: list[int],
    milliwatts: list[int],
    capped: int,
    seconds: float,
    millijoules: float,
    *,
    temperatures_c: list[int] | None = None,
) -> dict[str, float]:
    """A reading: the stretch's length, its energy by the counter and that energy's mean power
    (the counter moves in coarse steps: trust it over a second or more), the sampled power's
    mean, the SM clock's mean and minimum, the share of samples under the power cap, and the
    GPU temperature's mean and maximum (where sampled)."""
    samples = len(clocks_mhz)
    temperatures = temperatures_c or []
    reading = {
        "seconds": round(seconds, 3),
        "joules": round(millijoules / 1e3, 2),
        "watts": round(millijoules / 1e3 / seconds, 1) if seconds > 0 else 0.0,
        "watts_sampled": round(sum(milliwatts) / len(milliwatts) / 1e3, 1) if milliwatts else 0.0,
        "sm_mhz_mean": round(sum(clocks_mhz) / samples) if samples else 0,
        "sm_mhz_min": min(clocks_mhz) if samples else 0,
        "power_capped_share": round(capped / samples, 3) if samples else 0.0,
        "samples": samples,
    }
    if temperatures:
        reading["temp_c_mean"] = round(sum(temperatures) / len(temperatures), 1)
        reading["temp_c_max"] = max(temperatures)
    return reading


class PowerMeter:
    """NVML's total-energy counter at entry and exit, and the SM clock, power and clock event
    reasons sampled on a thread in between; entered again, it adds the new stretch to the
    ones before."""

    def __init__(self, target: int | str) -> None:
        import pynvml  # noqa: PLC0415 (present where there is a GPU to read)

        self._nvml = pynvml
        self._target = target
        # nvidia-ml-py renamed the throttle reasons to clock event reasons (12.535)
        self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        # every query once, so that a board without one fails here (power_meter logs it) and
        # not in the middle of a benchmark
        handle = self._open()
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            pynvml.nvmlDeviceGetPowerUsage(handle)
            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            self._reasons(handle)
        finally:
            pynvml.nvmlShutdown()
        self._handle = None
        self._clocks: list[int] = []
        self._milliwatts: list[int] = []
        self._temperatures: list[int] = []
        self._capped = 0
        self._seconds = 0.0
        self._millijoules = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_mj = 0
        self._start_s = 0.0

    def _open(self) -> object:
        """NVML started (a reference count: nvmlShutdown undoes one nvmlInit) and the board's
        handle; NVML shut down again if there is no such board."""
        nvml = self._nvml
        nvml.nvmlInit()
        try:
            if isinstance(self._target, int):
                return nvml.nvmlDeviceGetHandleByIndex(self._target)
            return nvml.nvmlDeviceGetHandleByUUID(self._target)
        except nvml.NVMLError:
            nvml.nvmlShutdown()
            raise

    def _sample(self, handle: object) -> None:
        nvml = self._nvml
        while True:
            self._clocks.append(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            self._milliwatts.append(nvml.nvmlDeviceGetPowerUsage(handle))
            self._temperatures.append(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            )
            self._capped += bool(self._reasons(handle) & SW_POWER_CAP)
            # the period's wait ends at once when the meter stops: its exit does not wait out
            # a sleep (which sat inside the decode figures' window until 68af27d)
            if self._stop.wait(SAMPLE_S):
                return

    def __enter__(self) -> PowerMeter:
        if self._thread is not None:
            raise RuntimeError("this power meter is already measuring")
        self._handle = self._open()
        try:
            self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except self._nvml.NVMLError:
            self._nvml.nvmlShutdown()
            raise
        self._start_s = time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, args=(self._handle,),
                                        name="power-meter", daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self._millijoules += (
                self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj
            )
            self._seconds += time.perf_counter() - self._start_s
        finally:  # the sampler stops and NVML shuts down even if the counter's read failed
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._thread = None
            self._handle = None
            self._nvml.nvmlShutdown()

    def reading(self) -> dict[str, float]:
        """The summary (``summarize``) of every stretch measured so far."""
        return summarize(self._clocks, self._milliwatts, self._capped, self._seconds,
                         self._millijoules, temperatures_c=self._temperatures)  # fmt: skip


def power_meter(device: torch.device) -> PowerMeter | None:
    """A meter for ``device``'s board, or None: off CUDA, without nvidia-ml-py, or where NVML
    fails to start (logged: the benchmark's figures stand without their power state)."""
    if device.type != "cuda" or importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml  # noqa: PLC0415

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return PowerMeter(nvml_target(ordinal, os.environ.get("CUDA_VISIBLE_DEVICES")))
    except (pynvml.NVMLError, ValueError) as error:
        logger.warning("no power readings for %s: %s", device, error)
        return None
