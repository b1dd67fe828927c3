"""`gptoss-serve bench`: the engine offline (no HTTP) on one model, one table, one JSON.

Each scenario starts from a fresh engine core (empty prefix cache) over the same runner and
KV cache, with random prompts that share no prefix. Times are wall-clock over engine steps,
which include the host's scheduling and the one sync per step, as a server sees them.
Ceilings are bandwidth (decode) or tensor-core (prefill) bounds from docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gptoss_serve.benchmarks.power import PowerMeter
from gptoss_serve.config import ModelConfig, SamplingParams
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.kv_sizing import KvCacheSpec
from gptoss_serve.kernels.moe import expert_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceRates:
    """What a GPU's ceilings are computed from: its device-to-device copy rate and its dense
    bf16 tensor-core rate, both as bench/kernels.py measures them."""

    copy_bytes_per_s: float
    dense_flop_per_s: float


# bench/results/kernels.json (H200) and kernels_h100.json (H100 80GB HBM3).
H200_RATES = DeviceRates(copy_bytes_per_s=4.3e12, dense_flop_per_s=790e12)
H100_RATES = DeviceRates(copy_bytes_per_s=3.02e12, dense_flop_per_s=795e12)


def device_rates(device_name: str) -> DeviceRates:
    """The rates of the GPU named ``device_name`` (torch.cuda.get_device_name): an H100's
    measured ones for an H100, else the H200's (the targets' card)."""
    return H100_RATES if "H100" in device_name else H200_RATES


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    ceiling: float | None
    unit: str
    power: dict | None = None  # the board's state while it ran (benchmarks/power.py)
    trials: tuple[float, ...] = ()  # each run's value, in run order, where value is their median

    @property
    def percent(self) -> float | None:
        if not self.ceiling:
            return None
        return 100 * self.value / self.ceiling


def decode_ceiling_tok_s(
    config: ModelConfig,
    batch: int,
    context: int,
    rates: DeviceRates = H200_RATES,
    *,
    kv_element_bytes: int = 2,
) -> float:
    """Tokens/s if one decode step only read its bytes at the copy rate: every non-expert
    weight, the distinct experts ``batch`` tokens touch per layer, and each sequence's KV
    (``kv_element_bytes`` an element: 1 for an FP8 cache)."""
    h, e, k = config.hidden_size, config.num_local_experts, config.num_experts_per_tok
    attention = (h * (config.q_dim + 2 * config.kv_dim) + config.q_dim * h) * 2
    router = e * h * 2
    expert = expert_bytes(h, config.intermediate_size)
    distinct = e * (1 - (1 - k / e) ** batch)
    weights = config.num_hidden_layers * (attention + router + distinct * expert)
    weights += config.vocab_size * h * 2
    spec = KvCacheSpec.from_model_config(config, dtype_bytes=kv_element_bytes)
    kv = spec.layer_token_bytes * (
        spec.num_full_layers * context + spec.num_sliding_layers * min(context, spec.sliding_window)
    )
    return batch * rates.copy_bytes_per_s / (weights + batch * kv)


def prefill_ceiling_tok_s(config: ModelConfig, rates: DeviceRates = H200_RATES) -> float:
    """Tokens/s of the matrix work alone (experts, attention projections, unembedding
    skipped: only the last token's) at the dense bf16 rate."""
    h, i, k = config.hidden_size, config.intermediate_size, config.num_experts_per_tok
    per_layer = 2 * (k * 3 * i * h + h * (config.q_dim + 2 * config.kv_dim) + config.q_dim * h)
    return rates.dense_flop_per_s / (config.num_hidden_layers * per_layer)


class Scenario:
    """Runs requests to completion on a fresh core and records when tokens arrived."""

    def __init__(
        self, make_core: Callable[[], EngineCore], vocab_size: int, seed: int,
        logprobs: int | None = None,
    ) -> None:  # fmt: skip
        """``logprobs``: each request's ``SamplingParams.logprobs`` (None: none asked)."""
        self.core = make_core()
        self.logprobs = logprobs
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.first_token_at: dict[str, float] = {}
        self.num_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}  # each request's prefix-cache hit

    def prompt(self, length: int) -> list[int]:
        """Random ids below 200000 (the real vocabulary's ordinary tokens): no shared prefix."""
        return [self.rng.randrange(min(self.vocab_size, 200_000)) for _ in range(length)]

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        self.add_tokens(request_id, self.prompt(prompt_len), max_tokens)

    def add_tokens(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                                seed=self.rng.getrandbits(31), logprobs=self.logprobs)  # fmt: skip
        self.core.add_request(request_id, prompt, params)
        self.num_tokens[request_id] = 0

    def step(self) -> None:
        """One engine step, recording each request's first-token time and token count."""
        result = self.core.step()
        now = time.perf_counter()
        if result.failed:
            raise RuntimeError(f"requests failed in the benchmark: {result.failed}")
        for output in result.outputs:
            self.first_token_at.setdefault(output.request_id, now)
            self.cached_tokens.setdefault(output.request_id, output.num_cached_tokens)
            self.num_tokens[output.request_id] += len(output.new_token_ids)

    def run(self) -> float:
        """Steps until every request finished; returns the wall time."""
        started = time.perf_counter()
        while self.core.has_unfinished_requests:
            self.step()
        elapsed = time.perf_counter() - started
        self.core.close()
        return elapsed


def decode_tok_s(
    make_core: Callable[[], EngineCore], config: ModelConfig, *, batch: int, context: int,
    num_tokens: int, meter: PowerMeter | None = None, logprobs: int | None = None,
) -> float:  # fmt: skip
    """Aggregate decode rate once every sequence has its first token (prefill excluded);
    ``logprobs``: what every request asks for (None: no log-probabilities);
    ``meter`` reads the board's power state over the timed steps. The time is the steps'
    alone (``Scenario.run``'s): not the meter's start (NVML's init, its sampler thread) and
    stop (the thread's join, up to a sample's sleep), nor the core's close: 18-22 ms that had
    cost the batch-1 figure 3.6% (~0.55 s of steps; bench/RESULTS.md e38)."""
    scenario = Scenario(make_core, config.vocab_size, seed=batch * 7919 + context,
                        logprobs=logprobs)  # fmt: skip
    for index in range(batch):
        scenario.add(f"decode-{index}", context, num_tokens)
    started = time.perf_counter()
    # Run the prefills (and the first tokens) first, then time the decode steps alone.
    while len(scenario.first_token_at) < batch:
        scenario.step()
    logger.info("batch %d ctx %d: prefill %.2fs", batch, context, time.perf_counter() - started)
    already = sum(scenario.num_tokens.values())
    with meter or contextlib.nullcontext():
        elapsed = scenario.run()
    return (sum(scenario.num_tokens.values()) - already) / elapsed


PREFILL_TRIALS = 5  # a prefill of 2048 tokens takes ~55 ms on an H200: one is too few


def prefill_rates(
    make_core: Callable[[], EngineCore], config: ModelConfig, length: int,
    meter: PowerMeter | None = None, trials: int = PREFILL_TRIALS,
) -> list[float]:  # fmt: skip
    """Prompt tokens per second of one request's prefill, to its first token, in each of
    ``trials`` runs on a fresh core (in run order); ``meter`` reads the board's power state
    over the runs (not their set-up)."""
    rates = []
    for trial in range(trials):
        scenario = Scenario(make_core, config.vocab_size, seed=length + trial)
        scenario.add("prefill", length, 1)
        with meter or contextlib.nullcontext():
            rates.append(length / scenario.run())
    return rates


def turn_after_history(
    make_core: Callable[[], EngineCore], config: ModelConfig, *, cached: int, new: int,
    seed: int, around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[float, int]:  # fmt: skip
    """An agent's next turn: on a fresh core, a request of ``cached`` prompt tokens runs to
    its first token (the history), then one of those tokens and ``new`` more (the turn) runs
    to its first token inside ``around()``. Returns the turn's seconds (``Scenario.run``'s) and
    how many of its prompt tokens the prefix cache gave (whole blocks of the history)."""
    scenario = Scenario(make_core, config.vocab_size, seed=seed)
    history = scenario.prompt(cached)
    if history:
        scenario.add_tokens("history", history, 1)
        while scenario.core.has_unfinished_requests:
            scenario.step()
    scenario.add_tokens("turn", history + scenario.prompt(new), 1)
    with around():
        elapsed = scenario.run()
    return elapsed, scenario.cached_tokens["turn"]


def max_throughput_tok_s(
    make_core: Callable[[], EngineCore], config: ModelConfig, *, num_seqs: int, length: int,
    meter: PowerMeter | None = None,
) -> float:  # fmt: skip
    """``num_seqs`` requests of ``length`` prompt and ``length`` output tokens all submitted
    at once: output tokens over the whole run's wall time (prefills included), ``meter``
    reading the board over it."""
    scenario = Scenario(make_core, config.vocab_size, seed=4242)
    for index in range(num_seqs):
        scenario.add(f"throughput-{index}", length, length)
    with meter or contextlib.nullcontext():
        elapsed = scenario.run()
    return sum(scenario.num_tokens.values()) / elapsed


def peak_memory_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else 0.0


def format_table(figures: list[Figure]) -> str:
    lines = [f"{'figure':<28} {'value':>12} {'ceiling':>12} {'%':>6}  unit"]
    for figure in figures:
        ceiling = f"{figure.ceiling:12.1f}" if figure.ceiling else f"{'-':>12}"
        percent = f"{figure.percent:6.1f}" if figure.percent is not None else f"{'-':>6}"
        spread = ""
        if figure.trials:
            spread = (f" (median of {len(figure.trials)}: {min(figure.trials):.1f} to "
                      f"{max(figure.trials):.1f})")  # fmt: skip
        lines.append(f"{figure.name:<28} {figure.value:12.1f} {ceiling} {percent}  "
                     f"{figure.unit}{spread}")  # fmt: skip
    metered = [figure for figure in figures if figure.power]
    if metered:
        lines.append(f"\n{'the board while it ran':<28} {'SM MHz':>12} {'min':>6} {'W':>6} "
                     f"{'capped':>7} {'°C':>5}")  # fmt: skip
        for figure in metered:
            power = figure.power
            temperature = f"{power['temp_c_mean']:5.0f}" if "temp_c_mean" in power else "    -"
            lines.append(
                f"{figure.name:<28} {power['sm_mhz_mean']:12d} {power['sm_mhz_min']:6d} "
                f"{power['watts_sampled']:6.0f} {100 * power['power_capped_share']:6.0f}% "
                f"{temperature}"
            )
    return "\n".join(lines)
