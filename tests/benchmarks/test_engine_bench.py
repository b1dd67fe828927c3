"""The engine bench (benchmarks/engine_bench.py, engine_run.py) without a GPU: its ceilings
(engine.json's H200 figures, an H100's from its own rates) and the seats it asks for."""

from __future__ import annotations

import pytest

from gptoss_serve.benchmarks import engine_bench as eb
from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig


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
