"""The engine bench (benchmarks/engine_bench.py, engine_run.py) without a GPU: its ceilings
(engine.json's H200 figures, an H100's from its own rates), the seats it asks for, and the
heap it runs the scenarios with."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.benchmarks import engine_run
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.weights import ModelWeights, load_weights


def test_ceilings_follow_the_card() -> None:
    config = ModelConfig.from_dict(preset_config("120b"))
    h200 = eb.device_rates("NVIDIA H200")
    h100 = eb.device_rates("NVIDIA H100 80GB HBM3")
    assert h200 is eb.H200_RATES and h100 is eb.H100_RATES
    assert eb.device_rates("cpu") is eb.H200_RATES  # the targets' card where unknown
    # bench/results/engine.json (H200, 256 decode tokens: the mean context is 1k + 128).
    assert eb.decode_ceiling_tok_s(config, 1, 1024 + 128, h200) == pytest.approx(851.6, abs=0.1)
    assert eb.decode_ceiling_tok_s(config, 64, 1024 + 128) == pytest.approx(4655.4, abs=0.1)
    assert eb.prefill_ceiling_tok_s(config) == pytest.approx(87029.4, abs=0.1)
    # An H100 copies at 3.02 TB/s: its decode ceilings scale with that, prefill barely moves.
    ratio = h100.copy_bytes_per_s / h200.copy_bytes_per_s
    for batch in (1, 8, 64):
        assert eb.decode_ceiling_tok_s(config, batch, 1152, h100) == pytest.approx(
            ratio * eb.decode_ceiling_tok_s(config, batch, 1152, h200)
        )
    assert eb.decode_ceiling_tok_s(config, 1, 1152, h100) == pytest.approx(598.1, abs=0.1)
    # An FP8 cache reads half the KV bytes: a higher ceiling, the more so at long context.
    gains = [
        eb.decode_ceiling_tok_s(config, 1, context, h100, kv_element_bytes=1)
        / eb.decode_ceiling_tok_s(config, 1, context, h100)
        for context in (1152, 8320)
    ]
    assert 1 < gains[0] < gains[1]
    assert eb.prefill_ceiling_tok_s(config, h100) > eb.prefill_ceiling_tok_s(config, h200)


def _tiny8_engine(
    checkpoint_dirs: dict[str, Path], *, max_num_seqs: int, kv_cache_tokens: int
) -> tuple[ModelWeights, EngineConfig]:
    """The tiny8 checkpoint's fp32 weights on the CPU and an engine config over them."""
    weights = load_weights(checkpoint_dirs["tiny8"], device="cpu", dtype=torch.float32,
                           progress=False)  # fmt: skip
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                max_model_len=256)  # fmt: skip
    config = EngineConfig(scheduler=scheduler, kv_cache_tokens=kv_cache_tokens,
                          reference_ops=True, use_cuda_graphs=False)  # fmt: skip
    return weights, config


def test_the_scenarios_run_with_the_start_up_heap_frozen(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the server runs them (server/app.py): a full collection during a figure walks only
    # what its requests made, and the heap is thawed once the figures are in.
    weights, config = _tiny8_engine(checkpoint_dirs, max_num_seqs=64, kv_cache_tokens=2048)
    frozen_before = gc.get_freeze_count()
    seen = []

    def figures(make_core, *args, **kwargs) -> list:
        seen.append(gc.get_freeze_count())
        core = make_core()  # the built engine serves
        core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, seed=0))
        while core.has_unfinished_requests:
            core.step()
        return []

    monkeypatch.setattr(engine_run, "_figures", figures)
    results = engine_run.run_engine_bench(weights, "tiny8", config, decode_tokens=4,
                                          throughput_seqs=4, commit="abc")  # fmt: skip
    assert seen and seen[0] > frozen_before
    assert gc.get_freeze_count() == frozen_before
    assert results["settings"]["piecewise_max_tokens"] == config.piecewise_max_tokens
    assert results["commit"] == "abc" and results["figures"] == []


def test_a_prefill_figure_keeps_each_trial(
    checkpoint_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # A 2048-token prefill takes ~55 ms on an H200, and the bench's figure moved by 15%
    # between two runs of one day: the median of several, each of them in the JSON.
    weights, config = _tiny8_engine(checkpoint_dirs, max_num_seqs=4, kv_cache_tokens=512)
    make_core, _, _ = build_engine(weights, config)
    rates = eb.prefill_rates(make_core, weights.config, 24, trials=3)
    assert len(rates) == 3 and all(rate > 0 for rate in rates)
    figures = [eb.Figure("prefill_2048_tok_s", 36000.0, 87029.4, "tok/s",
                         trials=(31000.0, 36000.0, 36400.0))]  # fmt: skip
    assert (
        eb.format_table(figures)
        .splitlines()[-1]
        .endswith("tok/s (median of 3: 31000.0 to 36400.0)")
    )
    out = tmp_path / "engine.json"
    engine_run.write_results({"device": "test", "figures": figures}, None, out)
    assert json.loads(out.read_text())["trials"] == {
        "prefill_2048_tok_s": [31000.0, 36000.0, 36400.0]
    }


def test_a_turn_after_its_history_reads_the_history_from_the_cache(
    checkpoint_dirs: dict[str, Path],
) -> None:
    # bench/prefix_prefill.py: an agent's turn computes only its new tokens; the history's
    # whole blocks come from the prefix cache (nothing cached without a history).
    weights, config = _tiny8_engine(checkpoint_dirs, max_num_seqs=4, kv_cache_tokens=512)
    make_core, _, _ = build_engine(weights, config)
    block = 16
    for cached, hit in ((0, 0), (3 * block, 3 * block), (3 * block + 5, 3 * block)):
        seconds, cached_tokens = eb.turn_after_history(
            make_core, weights.config, cached=cached, new=20, seed=cached
        )
        assert seconds > 0 and cached_tokens == hit
    entered = []

    class Around:
        def __enter__(self) -> None:
            entered.append(True)

        def __exit__(self, *exc: object) -> None:
            entered.append(False)

    eb.turn_after_history(make_core, weights.config, cached=block, new=4, seed=1, around=Around)
    assert entered == [True, False]


def test_the_figures_in_the_tables_order_with_their_ceilings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _figures on stand-in scenarios (the real ones need a GPU's speed): every figure, in the
    # table's order, each with its ceiling from the card's rates and its runs where it has them.
    model = ModelConfig.from_dict(preset_config("120b"))
    calls = []

    def decode(make_core, config, *, batch, context, num_tokens, meter=None) -> float:
        calls.append(("decode", batch, context))
        return 100.0 * batch

    monkeypatch.setattr(eb, "decode_tok_s", decode)
    monkeypatch.setattr(eb, "prefill_rates", lambda make_core, config, length, meter=None: [
        1000.0 + length, 3000.0 + length, 2000.0 + length, 5000.0, 4000.0])  # fmt: skip
    monkeypatch.setattr(eb, "max_throughput_tok_s", lambda *a, **k: 5000.0)
    monkeypatch.setattr(engine_run, "power_meter", lambda device: None)
    weights = SimpleNamespace(config=model, device=torch.device("cpu"), dtype=torch.bfloat16)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1024))
    figures = engine_run._figures(
        lambda: None, weights, config, SimpleNamespace(max_num_tokens=1_583_536),
        device="NVIDIA H200", decode_tokens=256, throughput_seqs=1024,
    )  # fmt: skip
    names = [figure.name for figure in figures]
    assert names == [
        "decode_bs1_ctx1k_tok_s", "decode_bs1_ctx8k_tok_s", "decode_conc8_tok_s",
        "decode_conc32_tok_s", "decode_conc64_tok_s", "prefill_2048_tok_s",
        "prefill_8192_tok_s", "ttft_1k_ms", "max_throughput_tok_s", "peak_gpu_memory_gb",
    ]  # fmt: skip
    assert calls[0] == ("decode", 1, 1024)  # the untimed warm-up decode first
    by_name = {figure.name: figure for figure in figures}
    prefill = by_name["prefill_2048_tok_s"]
    assert prefill.value == 4048.0 and prefill.trials == (3048.0, 5048.0, 4048.0, 5000.0, 4000.0)
    assert prefill.ceiling == pytest.approx(eb.prefill_ceiling_tok_s(model))
    ttft = by_name["ttft_1k_ms"]
    assert ttft.value == pytest.approx(1e3 * 1024 / 4000.0) and len(ttft.trials) == 5
    conc64 = by_name["decode_conc64_tok_s"]
    assert conc64.value == 6400.0
    assert conc64.ceiling == pytest.approx(eb.decode_ceiling_tok_s(model, 64, 1024 + 128))
    throughput = by_name["max_throughput_tok_s"]
    assert throughput.unit == "tok/s (773 seqs)"  # 1,583,536 KV tokens / 2k a sequence
    assert throughput.ceiling == pytest.approx(eb.decode_ceiling_tok_s(model, 773, 1536))


class _ClockedCore:
    """A stand-in engine core on a fake clock: each step gives every running request one
    token and takes one second."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.left: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.left[request_id] = params.max_tokens

    @property
    def has_unfinished_requests(self) -> bool:
        return any(self.left.values())

    def step(self) -> SimpleNamespace:
        self.clock[0] += 1.0
        outputs = [SimpleNamespace(request_id=r, new_token_ids=[0], num_cached_tokens=0)
                   for r, n in self.left.items() if n]  # fmt: skip
        self.left = {r: max(n - 1, 0) for r, n in self.left.items()}
        return SimpleNamespace(failed=[], outputs=outputs)

    def close(self) -> None:
        self.clock[0] += 50.0  # a slow close: not the steps' time


class _SlowMeter:
    """A power meter whose start and stop take 100 fake seconds each (NVML's init, the
    sampler thread's join)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def __enter__(self) -> _SlowMeter:
        self.clock[0] += 100.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.clock[0] += 100.0


def test_a_decode_figure_times_the_steps_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 sequences of 11 tokens: the first step gives the first tokens (prefill), then 10 steps
    # of 2 tokens, one second each: 2 tok/s, whatever the meter's start and stop or the core's
    # close cost (they had been inside the timed window: e38).
    clock = [0.0]
    monkeypatch.setattr(eb, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    config = ModelConfig.from_dict(preset_config("120b"))
    rate = eb.decode_tok_s(lambda: _ClockedCore(clock), config, batch=2, context=4,
                           num_tokens=11, meter=_SlowMeter(clock))  # fmt: skip
    assert rate == pytest.approx(2.0)
