"""The benchmarks' power readings (benchmarks/power.py) and where they go (engine_bench's table,
engine_run's JSON), without a GPU: the device mapping, the summary, the CPU's absent meter, and
a meter over a stand-in NVML that sums the stretches it was entered for."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.benchmarks import engine_run
from gptoss_serve.benchmarks.power import PowerMeter, nvml_target, power_meter, summarize


def test_the_cuda_ordinal_maps_through_cuda_visible_devices() -> None:
    assert nvml_target(0, None) == 0 and nvml_target(2, "") == 2
    assert nvml_target(1, "3, 1") == 1 and nvml_target(0, "3,1") == 3
    assert nvml_target(0, "GPU-5a1b") == "GPU-5a1b"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_target(2, "0,1")


def test_a_reading_summarizes_its_samples() -> None:
    reading = summarize([1980, 1500, 1830], [690_000, 700_000], capped=2, seconds=2.0,
                        millijoules=1_380_000)  # fmt: skip
    assert reading == {
        "seconds": 2.0, "joules": 1380.0, "watts": 690.0, "watts_sampled": 695.0,
        "sm_mhz_mean": 1770, "sm_mhz_min": 1500, "power_capped_share": 0.667, "samples": 3,
    }  # fmt: skip
    empty = summarize([], [], capped=0, seconds=0.0, millijoules=0)
    assert empty["samples"] == 0 and empty["watts"] == 0.0 and empty["sm_mhz_min"] == 0


def test_no_meter_off_cuda() -> None:
    assert power_meter(torch.device("cpu")) is None


def test_the_table_and_the_json_carry_the_readings(tmp_path: Path) -> None:
    reading = summarize([1800, 1700], [690_000], capped=1, seconds=1.5, millijoules=1_000_000)
    figures = [
        eb.Figure("decode_conc64_tok_s", 3600.0, 4655.4, "tok/s", reading),
        eb.Figure("ttft_1k_ms", 41.0, None, "ms"),
    ]
    table = eb.format_table(figures)
    assert "the board while it ran" in table
    assert table.splitlines()[-1].split() == [
        "decode_conc64_tok_s", "1750", "1700", "690", "50%", "-"
    ]  # fmt: skip
    assert "the board" not in eb.format_table(figures[1:])
    out = tmp_path / "engine.json"
    engine_run.write_results({"device": "test", "figures": figures}, None, out)
    written = json.loads(out.read_text())
    assert written["power"] == {"decode_conc64_tok_s": reading}
    assert written["decode_conc64_tok_s"] == 3600.0


class _FakeNvml(types.ModuleType):
    """The few pynvml calls PowerMeter makes: a board at 1,700 MHz drawing 650 W under the
    power cap, whose energy counter gains 650 mJ per call of it, with init/shutdown counted."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.inits = 0
        self.millijoules = 0
        self.energy_fails = False

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
        if index != 0:
            raise self.NVMLError("no such board")
        return "board"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
        if self.energy_fails:
            raise self.NVMLError("the counter is gone")
        self.millijoules += 650
        return self.millijoules

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:  # noqa: N802
        return 1700

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:  # noqa: N802
        return 650_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:  # noqa: N802
        return 0x4

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:  # noqa: N802
        return 61


def test_a_meter_entered_twice_sums_both_stretches(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    meter = PowerMeter(0)
    assert nvml.inits == 0  # its checks at construction leave NVML as they found it
    for _ in range(2):
        with meter:
            assert nvml.inits == 1
            with pytest.raises(RuntimeError, match="already measuring"):
                meter.__enter__()
            time.sleep(0.05)
    assert nvml.inits == 0
    reading = meter.reading()
    assert reading["joules"] == 1.3  # 650 mJ between entry and exit, twice
    assert 0.1 <= reading["seconds"] < 1.0
    assert reading["samples"] >= 2 and reading["sm_mhz_mean"] == 1700
    assert reading["watts_sampled"] == 650.0 and reading["power_capped_share"] == 1.0
    assert reading["temp_c_mean"] == 61.0 and reading["temp_c_max"] == 61
    figure = eb.Figure("decode_conc64_tok_s", 3600.0, 4655.4, "tok/s", reading)
    assert eb.format_table([figure]).splitlines()[-1].split()[-1] == "61"
    with pytest.raises(nvml.NVMLError):
        PowerMeter(1)
    assert nvml.inits == 0
    # a read that fails mid-benchmark is raised, and leaves no sampler running, NVML shut down
    with pytest.raises(nvml.NVMLError), meter:
        nvml.energy_fails = True
    assert nvml.inits == 0 and meter._thread is None
    with pytest.raises(nvml.NVMLError), meter:
        pass
    assert nvml.inits == 0
