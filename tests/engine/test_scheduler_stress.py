"""Random requests, aborts and finishes against small pools; invariants after every step.
Each case runs stepped in turn and with async scheduling (the next step scheduled while the
last one is in flight: ``AheadDriver``)."""

from __future__ import annotations

import random

import pytest
from factories import STOP, AheadDriver, FakeModel, check_invariants, make_scheduler, step

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.kv_manager import SLIDING_GROUP, sliding_pool_bound
from gptoss_serve.engine.request import Request
from gptoss_serve.engine.scheduler import Scheduler

VOCAB = 50


def _expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What the fake model generates for a prompt run alone (its tokens depend only on the
    sequence, so the same must come out of any batch, preempted or not)."""
    tokens, output, current = [], [], 17
    for token in prompt:
        current = hash((current, token)) & 0xFFFFFFFF
        tokens.append(token)
    while True:
        token = current % VOCAB
        output.append(token)
        tokens.append(token)
        if token == STOP or len(output) == max_tokens or len(tokens) >= max_model_len:
            return output
        current = hash((current, token)) & 0xFFFFFFFF


def _random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
    prefix = prefix[: rng.randint(0, len(prefix))]
    return prefix + [rng.randrange(1, 3000) for _ in range(rng.randint(1, 70))]


def _run(
    scheduler: Scheduler, seed: int, ahead: bool, num_requests: int = 60, bursts: bool = False
) -> None:
    rng = random.Random(seed)
    model = FakeModel(scheduler, vocab=VOCAB)
    driver = AheadDriver(scheduler, model) if ahead else None
    config = scheduler.config
    prefixes = [[rng.randrange(1, 3000) for _ in range(rng.randint(16, 90))] for _ in range(3)]
    expected, streamed, aborted = {}, {}, set()
    next_id = 0
    for _ in range(3000):
        if next_id < num_requests and rng.random() < 0.4:
            prompt = _random_prompt(rng, prefixes)
            max_tokens = rng.randint(1, 40)
            # With bursts, at times the same prompt more than once (a chat request's choices).
            for _ in range(rng.choice((1, 1, 1, 2, 3)) if bursts else 1):
                request_id = f"r{next_id}"
                next_id += 1
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,))
                scheduler.add_request(Request(request_id, prompt, params))
                expected[request_id] = _expected_output(prompt, max_tokens, config.max_model_len)
        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(scheduler.requests))
            assert scheduler.abort_request(victim)
            aborted.add(victim)
        if not scheduler.has_unfinished_requests:
            if next_id >= num_requests:
                break
            continue
        if driver is not None:
            output, results = driver.step()
            if output is None:
                continue
        else:
            output, results = step(scheduler, model)
        assert output.num_tokens <= config.max_num_batched_tokens
        assert all(s.num_new_tokens <= config.chunk_tokens for s in output.scheduled)
        assert all(s.is_decode for s in output.scheduled[: output.num_decodes])
        assert not any(s.is_decode for s in output.scheduled[output.num_decodes :])
        for result in results:
            streamed.setdefault(result.request_id, []).extend(result.new_token_ids)
        check_invariants(scheduler, None if driver is None else driver.in_flight)
    assert next_id >= num_requests and not scheduler.has_unfinished_requests
    for request_id, tokens in expected.items():
        if request_id not in aborted:
            assert streamed[request_id] == tokens, request_id
    for pool in scheduler.kv.pools:
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_stress_with_sliding_pool_at_its_bound(seed: int, ahead: bool) -> None:
    seqs, budget, window = 4, 48, 32
    scheduler = make_scheduler(
        num_full_blocks=20,  # 320 tokens for up to 4 sequences of up to 200: preemptions
        num_sliding_blocks=sliding_pool_bound(window, seqs, budget),
        window=window,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_chunk_tokens=24 if seed % 2 else None,
        max_model_len=200,
    )
    _run(scheduler, seed, ahead)
    stats = scheduler.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    # Sized by its bound, the sliding pool never ran short: only the full pool preempts.
    assert scheduler.kv.num_refusals[SLIDING_GROUP] == 0


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(4, 8))
def test_stress_with_a_tight_sliding_pool(seed: int, ahead: bool) -> None:
    scheduler = make_scheduler(
        num_full_blocks=24, num_sliding_blocks=7, window=32, max_num_seqs=6,
        max_num_batched_tokens=32, max_model_len=160, enable_prefix_caching=seed % 2 == 0,
    )  # fmt: skip
    _run(scheduler, seed, ahead)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(8, 10))
def test_stress_full_attention_only(seed: int, ahead: bool) -> None:
    scheduler = make_scheduler(
        num_full_blocks=16, num_sliding_blocks=None, max_num_seqs=8,
        max_num_batched_tokens=64, max_chunk_tokens=16, max_model_len=200,
    )  # fmt: skip
    _run(scheduler, seed, ahead)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(10, 14))
def test_stress_with_bursts_of_one_prompt(seed: int, ahead: bool) -> None:
    scheduler = make_scheduler(
        num_full_blocks=20, num_sliding_blocks=sliding_pool_bound(32, 4, 48), window=32,
        max_num_seqs=4, max_num_batched_tokens=48, max_model_len=200,
    )  # fmt: skip
    _run(scheduler, seed, ahead, bursts=True)
    assert scheduler.stats().num_prefix_waits > 0  # requests held back for a running prefill
