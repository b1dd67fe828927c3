"""The seat count of `--max-num-seqs auto` (engine/seats.py), and the flag that asks for it.

CPU: the settling loop over a stand-in of the GPU's measurement, and the CLI's parsing. The
GPU engine built with the flag is in test_engine_gpu.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from gptoss_serve import cli
from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine import seats, startup
from gptoss_serve.engine.startup import settled_config


def _auto(requested: int = seats.MAX_SEATS) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=requested), fit_max_num_seqs=True)


def test_seats_are_what_fits_measured_again_at_the_count_found() -> None:
    # Fewer seats leave more room (their logits), as on the GPU: 63 fit at 1024, 171 at 64.
    fits = {1024: 63, 64: 171, 171: 168, 168: 168}
    tried = []

    def fits_at(count: int) -> int:
        tried.append(count)
        return fits[count]

    assert seats.settle_seats(fits_at, requested=1024, floor=64) == 168
    assert tried == [1024, 64, 171, 168]


@pytest.mark.parametrize(
    ("fit", "requested", "floor", "expected"),
    [(5000, 1024, 64, 1024), (10, 1024, 64, 64), (0, 1024, 64, 64), (100, 1024, 64, 100),
     (100, 80, 64, 80)],
)  # fmt: skip
def test_seats_stay_between_the_floor_and_the_request(
    fit: int, requested: int, floor: int, expected: int
) -> None:
    assert seats.settle_seats(lambda _: fit, requested=requested, floor=floor) == expected


def test_a_swing_between_two_counts_ends_on_the_one_that_fits_beside_its_own_seats() -> None:
    # An H100 under a test's cap (GPU test_auto_seats_...): 402 fit beside 1024 seats, 412
    # beside 402, 411 beside 412, 412 beside 411. 412 seats would hold only 411 sequences.
    fits = {1024: 402, 402: 412, 412: 411, 411: 412}
    calls = []

    def fits_at(count: int) -> int:
        calls.append(count)
        return fits[count]

    assert seats.settle_seats(fits_at, requested=1024, floor=64) == 411
    assert calls == [1024, 402, 412, 411]  # stops at the swing, before ROUNDS runs out

    def alternating(count: int) -> int:
        calls.append(count)
        return 100 if count != 100 else 200

    calls.clear()
    assert seats.settle_seats(alternating, requested=1024, floor=64) == 100
    assert calls == [1024, 100, 200]


def test_settling_stops_after_its_rounds_on_a_count_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def sliding(count: int) -> int:  # never settles: one fewer than the seats, every time
        calls.append(count)
        return count - 1

    assert seats.settle_seats(sliding, requested=1024, floor=64) == 1024 - seats.ROUNDS
    assert len(calls) == seats.ROUNDS
    # The largest count measured that fits beside its own seats (300 and 305 do; 310 does not).
    monkeypatch.setattr(seats, "ROUNDS", 4)
    fits = {1024: 300, 300: 310, 310: 305, 305: 309}
    assert seats.settle_seats(fits.__getitem__, requested=1024, floor=64) == 305


def test_fit_seats_measures_configs_of_the_tried_count_and_settles_the_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = []

    def fits_at(config: EngineConfig) -> int:
        seen.append((config.scheduler.max_num_seqs, config.fit_max_num_seqs))
        return 300

    with caplog.at_level(logging.WARNING, logger="gptoss_serve.engine.seats"):
        settled = seats.fit_seats(_auto(), fits_at)
    assert settled.scheduler.max_num_seqs == 300 and not settled.fit_max_num_seqs
    assert seen == [(1024, False), (300, False)]  # measured without asking again
    assert "max_num_seqs 300 (of 1024)" in caplog.text and "300 at 1024" in caplog.text


def test_fit_seats_leaves_a_fixed_count_alone() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8))

    def never(_: EngineConfig) -> int:
        raise AssertionError("a fixed count is not measured")

    assert seats.fit_seats(config, never) is config


def test_seats_without_a_device_to_measure_are_the_old_default() -> None:
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert settled_config(cpu, _auto()).scheduler.max_num_seqs == seats.MIN_SEATS
    assert settled_config(cpu, _auto(16)).scheduler.max_num_seqs == 16
    given = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=200))
    assert settled_config(cpu, given) is given
    sized = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1024), kv_cache_tokens=4096,
                         fit_max_num_seqs=True)  # fmt: skip
    assert not settled_config(cpu, sized).fit_max_num_seqs


def test_seats_on_a_gpu_are_measured_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a card whose KV budget holds fewer 2k-token sequences than the requested seats (an
    80 GB H100: 28 at 0.9 before the allocator fix), the engine gets that many seats, but never
    fewer than 64; where they fit, the request stands; an explicit cache is not measured."""
    gpu = SimpleNamespace(device=torch.device("cuda"))  # only its type is read
    profiled = []
    monkeypatch.setattr(startup, "_forward_bytes", lambda *a: profiled.append(a) or 5 << 30)
    for fit, expected in ((28, 64), (300, 300), (5000, 1024)):
        monkeypatch.setattr(startup, "seqs_that_fit_gpu", lambda *a, fit=fit, **k: fit)
        assert settled_config(gpu, _auto()).scheduler.max_num_seqs == expected
    given = EngineConfig(kv_cache_tokens=4096, fit_max_num_seqs=True)
    assert settled_config(gpu, given).scheduler.max_num_seqs == seats.MIN_SEATS

    # The step's reserve shrinks with the seats, so fewer seats leave room for more sequences
    # (an FP8 cache on an H100: 63 fit beside 1024 seats, 104 beside 64): measured again, with
    # the forward pass profiled once for every count tried (or not at all when given).
    def fit_at(weights, config: EngineConfig, *, tokens_per_seq: int, forward_bytes: int) -> int:
        assert tokens_per_seq == seats.SEAT_TOKENS and not config.fit_max_num_seqs
        tried.append((config.scheduler.max_num_seqs, forward_bytes))
        count = config.scheduler.max_num_seqs
        return 63 if count > 500 else 104 - count // 50

    monkeypatch.setattr(startup, "seqs_that_fit_gpu", fit_at)
    profiled.clear()
    tried: list[tuple[int, int]] = []
    assert settled_config(gpu, _auto()).scheduler.max_num_seqs == 102
    assert len(profiled) == 1
    assert tried == [(1024, 5 << 30), (64, 5 << 30), (103, 5 << 30), (102, 5 << 30)]
    tried.clear()
    assert settled_config(gpu, _auto(), forward_bytes=7).scheduler.max_num_seqs == 102
    assert len(profiled) == 1 and {b for _, b in tried} == {7}


def _parsed(*flags: str):
    return cli.build_parser().parse_args(["serve", "--model", "demo", *flags])


def test_max_num_seqs_defaults_to_auto() -> None:
    config = cli.engine_config(_parsed())
    assert config.fit_max_num_seqs and config.scheduler.max_num_seqs == seats.MAX_SEATS
    assert cli.engine_config(_parsed("--max-num-seqs", "auto")) == config
    fixed = cli.engine_config(_parsed("--max-num-seqs", "48"))
    assert not fixed.fit_max_num_seqs and fixed.scheduler.max_num_seqs == 48


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_a_bad_max_num_seqs_names_the_flag(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as raised:
        _parsed("--max-num-seqs", value)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs" in err and "Traceback" not in err
