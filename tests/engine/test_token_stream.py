"""A step's tokens cross from the worker thread to the event loop in one hop, in order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.client import EngineError
from gptoss_serve.engine.token_stream import DONE, TokenStream, post_all


async def _read(stream: TokenStream) -> list[int]:
    return [token async for token in stream.tokens()]


def test_post_all_delivers_each_stream_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        streams = [TokenStream.open(f"r{i}", [1], SamplingParams()) for i in range(3)]
        wake_ups = 0
        threadsafe = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wake_ups
            wake_ups += 1
            return threadsafe(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        steps = [[(s, 10 * i + step) for i, s in enumerate(streams)] for step in range(4)]
        steps[-1] += [(s, DONE) for s in streams]

        def worker() -> None:  # one post_all a step, from another thread, as the engine does
            for posts in steps:
                post_all(posts)

        thread = threading.Thread(target=worker)
        thread.start()
        results = await asyncio.gather(*(_read(s) for s in streams))
        thread.join()
        return results, wake_ups

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
