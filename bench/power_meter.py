"""The board's energy, power and SM clock over a stretch of GPU work, read through NVML
(nvidia-ml-py, ``import pynvml``; present on the GPU machine): at 32-64 decode sequences the
H200 runs at its 700 W software power cap and lowers its SM clock (bench/RESULTS.md e35), so a
step's time follows its energy, and a change is judged by both.

    with PowerMeter() as meter:   # None where NVML is missing
        ...GPU work, synchronized before the block ends...
    meter.result(steps)  # {"seconds", "joules", "watts", "watts_sampled", "mj_per_step",
                         #  "sm_mhz_mean", "sm_mhz_min", "power_capped_share"}
"""

from __future__ import annotations

import importlib.util
import threading
import time
from types import TracebackType

SAMPLE_S = 0.02  # the clock sampler's period (light on the GIL the engine's host needs)
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


class PowerMeter:
    """NVML's total-energy counter at entry and exit, and the SM clock and throttle reasons
    sampled on a thread in between, for device ``index`` (CUDA's ordinal on a one-GPU box)."""

    def __init__(self, index: int = 0) -> None:
        import pynvml  # noqa: PLC0415 (GPU machines only)

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        # nvidia-ml-py renamed the throttle reasons to clock event reasons (12.535)
        self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self._clocks: list[int] = []
        self._milliwatts: list[int] = []
        self._capped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._start_mj = self._start_s = self._end_mj = self._end_s = 0.0

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("pynvml") is not None

    def _sample(self) -> None:
        nvml = self._nvml
        while not self._stop.is_set():
            self._clocks.append(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
            self._milliwatts.append(nvml.nvmlDeviceGetPowerUsage(self._handle))
            reasons = self._reasons(self._handle)
            self._capped += bool(reasons & SW_POWER_CAP)
            time.sleep(SAMPLE_S)

    def __enter__(self) -> PowerMeter:
        self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        self._start_s = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._end_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        self._end_s = time.perf_counter()
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()

    def result(self, steps: int) -> dict[str, float]:
        """Energy over the block by NVML's counter, its mean power and the energy a step; the
        sampled power's mean; the SM clock's mean and minimum; the share of samples under the
        power cap. The counter moves in steps: over 0.24 s (40 steps at batch 8) it gave 839 W
        under a 700 W cap (bench/RESULTS.md e35), so trust it over a second or more, and the
        sampled power over shorter blocks."""
        joules = (self._end_mj - self._start_mj) / 1e3
        seconds = self._end_s - self._start_s
        clocks = self._clocks or [0]
        milliwatts = self._milliwatts or [0]
        return {
            "seconds": round(seconds, 3),
            "joules": round(joules, 2),
            "watts": round(joules / seconds, 1),
            "watts_sampled": round(sum(milliwatts) / len(milliwatts) / 1e3, 1),
            "mj_per_step": round(1e3 * joules / steps, 1),
            "sm_mhz_mean": round(sum(clocks) / len(clocks)),
            "sm_mhz_min": min(clocks),
            "power_capped_share": round(self._capped / max(len(self._clocks), 1), 3),
        }
