"""A step's tokens cross from the worker thread to the event loop in one hop, in order."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.client import EngineError, EngineInfo, FinishedRequest
from gptoss_serve.engine.engine import StepResult
from gptoss_serve.engine.scheduler_output import RequestOutput, SchedulerStats
from gptoss_serve.engine.token_stream import DONE, TokenStream, post_all


def _count_wake_ups(loop: asyncio.AbstractEventLoop) -> list[tuple]:
    """Records every call_soon_threadsafe on ``loop`` (each wakes it) and lets it through."""
    calls: list[tuple] = []
    threadsafe = loop.call_soon_threadsafe

    def counting(*args):
        calls.append(args)
        return threadsafe(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return calls


async def _read(stream: TokenStream) -> list[int]:
    return [token async for token in stream.tokens()]


def test_post_all_delivers_each_stream_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        streams = [TokenStream.open(f"r{i}", [1], SamplingParams()) for i in range(3)]
        wake_ups = _count_wake_ups(loop)
        steps = [[(s, 10 * i + step) for i, s in enumerate(streams)] for step in range(4)]
        steps[-1] += [(s, DONE) for s in streams]

        def worker() -> None:  # one post_all a step, from another thread, as the engine does
            for posts in steps:
                post_all(posts)

        thread = threading.Thread(target=worker)
        thread.start()
        results = await asyncio.gather(*(_read(s) for s in streams))
        thread.join()
        return results, len(wake_ups)

    results, wake_ups = asyncio.run(main())
    assert results == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert wake_ups == 4  # one per step, not one per token


def test_post_all_ends_a_stream_with_its_error() -> None:
    async def main() -> None:
        stream = TokenStream.open("r", [1], SamplingParams())
        post_all([(stream, 5), (stream, EngineError("grammar refused"))])
        with pytest.raises(EngineError, match="grammar refused"):
            await _read(stream)

    asyncio.run(main())


def test_post_all_to_a_closed_loop_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    stream = TokenStream(request_id="r", prompt_ids=[1], params=SamplingParams(), loop=loop,
                         queue=asyncio.Queue())  # fmt: skip
    loop.close()
    post_all([(stream, 1), (stream, DONE)])  # nobody listens: no error in the worker


class _ScriptedCore:
    """An EngineCore stand-in: step n gives each request its n-th scripted output."""

    def __init__(self, steps: list[StepResult]) -> None:
        self.steps = list(steps)
        self.requests: list[str] = []

    def add_request(self, request_id: str, prompt_ids, params) -> None:
        self.requests.append(request_id)

    def abort_request(self, request_id: str) -> None:
        raise AssertionError(f"nothing should be aborted, got {request_id}")

    def step(self) -> StepResult:
        if len(self.requests) < 3 or not self.steps:  # the worker admits the rest meanwhile
            time.sleep(0.001)
            return StepResult([])
        return self.steps.pop(0)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.requests), 0, 0.0, 0.0, 0, 0, 0)

    def close(self) -> None:
        pass


def test_the_async_engine_hands_each_step_over_in_one_wake_up() -> None:
    steps = [
        StepResult([RequestOutput("a", (1,), None, 0), RequestOutput("b", (11,), None, 0),
                    RequestOutput("c", (21,), None, 0)], started=("a", "b", "c")),
        StepResult([RequestOutput("a", (2,), "stop", 3), RequestOutput("b", (12,), None, 0)],
                   failed={"c": "grammar refused token 22"}),
        StepResult([RequestOutput("b", (13,), "length", 0)]),
    ]  # fmt: skip
    core = _ScriptedCore(steps)

    async def main() -> tuple[dict, int, int]:
        loop = asyncio.get_running_loop()
        wake_ups = _count_wake_ups(loop)
        engine = AsyncEngine(lambda: core, EngineInfo("m", 64, 100, 0))

        async def read(request_id: str) -> list[int] | str:
            try:
                return [t async for t in engine.generate(request_id, [5], SamplingParams())]
            except EngineError as error:
                return str(error)

        results = await asyncio.gather(read("a"), read("b"), read("c"))
        steps_handed_over = len(wake_ups)  # (close's thread join wakes the loop once more)
        finished = {request_id: engine.finished(request_id) for request_id in "abc"}
        await engine.close()
        return dict(zip("abc", results, strict=True)), steps_handed_over, finished

    results, wake_ups, finished = asyncio.run(main())
    assert results == {"a": [1, 2], "b": [11, 12, 13], "c": "grammar refused token 22"}
    assert wake_ups == 3 and finished["a"].cached_tokens == 3  # a's prefix-cache hits are kept
    for request_id in "ab":  # when each was handed over, began, and had its first token
        times = finished[request_id]
        assert 0 <= times.queue_s < 5 and 0 <= times.prefill_s < 5
    assert finished["c"] == FinishedRequest()  # it failed: nothing kept
