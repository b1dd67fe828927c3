"""The CPU engine: interleaved requests, abort on close, one failure fails one request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gptoss_serve.config import SampledToken, SamplingParams
from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar
from gptoss_serve.engine.client import EngineError, EngineInfo, FinishedRequest
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.harmony import adapter
from gptoss_serve.model import generate as generate_module
from gptoss_serve.model import load_model
from gptoss_serve.model.generate import generate

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def model(checkpoint_dirs: dict[str, Path]):
    return load_model(checkpoint_dirs["tiny8"])


async def _collect(engine: CpuEngine, request_id: str, prompt: list[int], params) -> list[int]:
    return [token async for token in engine.generate(request_id, prompt, params)]


def test_concurrent_requests_match_running_alone(model) -> None:
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [500] * 40]
    alone = [list(generate(model, prompt, GREEDY)) for prompt in prompts]

    async def main() -> tuple[list[list[int]], list[FinishedRequest]]:
        engine = CpuEngine(model, "tiny", max_active=2)  # the third request waits its turn
        try:
            tokens = await asyncio.gather(
                *(_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
            )
            return tokens, [engine.finished(f"r{i}") for i in range(3)]
        finally:
            await engine.close()

    tokens, finished = asyncio.run(main())
    assert tokens == alone
    for times in finished:  # each began its prompt, then had a first token
        assert times.cached_tokens == 0 and times.queue_s >= 0 and times.prefill_s > 0
    # The third waited for one of the first two to finish: 12 tokens of a tiny model.
    assert finished[2].queue_s > max(finished[0].queue_s, finished[1].queue_s)
    assert asyncio.run(_forgotten(model)) == FinishedRequest()


async def _forgotten(model) -> FinishedRequest:
    """A request read once is forgotten; an unknown one is empty."""
    engine = CpuEngine(model, "tiny")
    try:
        await _collect(engine, "x", [1, 2], GREEDY)
        engine.finished("x")
        return engine.finished("x")
    finally:
        await engine.close()


def test_logprobs_are_the_models_log_softmax(model) -> None:
    prompt = [1, 2, 3, 4]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    tokens = list(generate(model, prompt, params))
    assert tokens == list(generate(model, prompt, GREEDY))[:6]  # the same draws
    ids = torch.tensor(prompt + tokens[:-1])
    expected = torch.log_softmax(model(ids, model.new_cache())[len(prompt) - 1 :].float(), -1)
    for row, token in enumerate(tokens):
        assert isinstance(token, SampledToken)
        assert token.logprob == pytest.approx(expected[row, token].item(), abs=1e-5)
        values, top_ids = expected[row].topk(3)
        assert [t for t, _ in token.top] == top_ids.tolist() and token.top[0][0] == token
        assert [v for _, v in token.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_a_prompt_prefilled_in_chunks_gives_the_same_tokens(model, monkeypatch) -> None:
    prompt = list(range(100, 170))  # 70 tokens: chunks of 16, the last of 6
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    whole = list(generate(model, prompt, params))
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 16)
    calls = []
    original = generate_module.Generation.prefill_step

    def counted(self) -> None:
        calls.append(self._prefilled)
        original(self)

    monkeypatch.setattr(generate_module.Generation, "prefill_step", counted)
    chunked = list(generate(model, prompt, params))
    assert calls == [0, 16, 32, 48, 64]
    assert chunked == whole
    for a, b in zip(chunked, whole, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_a_long_prefill_lets_others_run_and_stops_when_cancelled(model, monkeypatch) -> None:
    """Prefill chunks of 8: a 600-token prompt takes 75 passes of the worker. A short request
    sent after it gets all its tokens meanwhile, and cancelling the long one stops its prefill
    at the next chunk."""
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 8)
    chunks: list[int] = []
    original = generate_module.Generation.prefill_step

    def counted(self) -> None:
        if len(self._prompt) == 600:
            chunks.append(self._prefilled)
        original(self)

    monkeypatch.setattr(generate_module.Generation, "prefill_step", counted)

    async def main() -> None:
        engine = CpuEngine(model, "tiny")
        try:
            long = asyncio.create_task(_collect(engine, "long", [7] * 600, GREEDY))
            while not chunks:
                await asyncio.sleep(0.001)
            short = await _collect(engine, "short", [1, 2, 3], GREEDY)
            assert len(short) == GREEDY.max_tokens and not long.done()
            long.cancel()  # what a client that goes away does to its request
            with contextlib.suppress(asyncio.CancelledError):
                await long
            for _ in range(500):
                if not engine._active:
                    break
                await asyncio.sleep(0.01)
            assert not engine._active
        finally:
            await engine.close()

    asyncio.run(main())
    assert len(chunks) < 600 // 8, "the cancelled prefill ran to its end"


def test_a_context_cap_ends_the_output_and_refuses_longer_prompts(model) -> None:
    """--max-model-len on the CPU engine: prompt + output stop at the cap."""

    async def main() -> tuple[list[int], EngineInfo]:
        engine = CpuEngine(model, "tiny", max_context_tokens=40)
        try:
            long = SamplingParams(max_tokens=100, temperature=0.0)
            tokens = await _collect(engine, "r", list(range(1, 31)), long)
            with pytest.raises(EngineError, match="does not fit"):
                await _collect(engine, "s", list(range(1, 41)), long)
            return tokens, engine.info
        finally:
            await engine.close()

    tokens, info = asyncio.run(main())
    assert info.max_context_tokens == 40 and len(tokens) == 10
    wide = CpuEngine(model, "tiny", max_context_tokens=10**9)  # at most the model's
    assert wide.info.max_context_tokens == model.config.max_position_embeddings
    asyncio.run(wide.close())


def test_closing_the_stream_aborts(model) -> None:
    async def main() -> None:
        engine = CpuEngine(model, "tiny")
        long = SamplingParams(max_tokens=10_000, temperature=1.0, seed=1)
        stream = engine.generate("r", [1, 2, 3], long)
        received = [await anext(stream) for _ in range(3)]
        await stream.aclose()  # what the server does when the client disconnects
        for _ in range(200):
            if not engine._active:
                break
            await asyncio.sleep(0.01)
        assert len(received) == 3 and not engine._active
        await engine.close()

    asyncio.run(main())


def test_a_failing_request_does_not_stop_the_others(model) -> None:
    async def main() -> tuple[Exception | None, list[int]]:
        engine = CpuEngine(model, "tiny")
        bad = _collect(engine, "bad", [model.config.vocab_size + 5], GREEDY)  # id out of range
        good = _collect(engine, "good", [1, 2, 3], GREEDY)
        results = await asyncio.gather(bad, good, return_exceptions=True)
        await engine.close()
        return results

    failure, tokens = asyncio.run(main())
    assert isinstance(failure, EngineError) and "outside the vocabulary" in str(failure)
    assert len(tokens) == 12


def test_closed_engine_refuses_new_work(model) -> None:
    async def main() -> None:
        engine = CpuEngine(model, "tiny")
        await engine.close()
        with pytest.raises(EngineError):
            await _collect(engine, "late", [1], GREEDY)

    asyncio.run(main())


def test_requests_with_grammars_follow_them_and_a_bad_grammar_fails_alone(demo_dir) -> None:
    demo = load_model(demo_dir)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    grammar = build_grammar(ConstraintSpec(response_schema=schema, reasoning_budget=3))
    stops = adapter.assistant_stop_token_ids()
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, stop_token_ids=stops,
                            grammar=grammar)  # fmt: skip
    broken = SamplingParams(max_tokens=4, grammar="start: %json {")
    prompt = adapter.encode("Give me a number.")

    async def main() -> list:
        engine = CpuEngine(demo, "demo", max_active=3)
        try:
            return await asyncio.gather(
                _collect(engine, "a", prompt, params),
                _collect(engine, "bad", prompt, broken),
                _collect(engine, "b", prompt, dataclasses.replace(params, seed=8)),
                return_exceptions=True,
            )
        finally:
            await engine.close()

    first, failure, second = asyncio.run(main())
    assert isinstance(failure, EngineError)
    for tokens in (first, second):
        text = adapter.decode(tokens)
        assert tokens[-1] == adapter.special_token_id("<|return|>"), text
        final = text.rsplit("<|channel|>final<|message|>", 1)[1].removesuffix("<|return|>")
        assert 0 <= json.loads(final)["n"] <= 9
