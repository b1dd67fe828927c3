"""Large prompts rendered in a worker process (server/render_workers.py): the same prompt as a
render in this process, a refusal crossing the process boundary whole, the event loop free
while the renderer (which holds the GIL throughout) runs, and a dead worker replaced."""

from __future__ import annotations

import asyncio
import itertools
import pickle
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest

from gptoss_serve.config import ServerConfig
from gptoss_serve.harmony.conversation import Message, RenderRequest
from gptoss_serve.server import context_fit
from gptoss_serve.server.app import create_app
from gptoss_serve.server.errors import APIError
from gptoss_serve.server.render_workers import (
    MAX_BROKEN_POOLS,
    RENDER_IN_WORKER_CHARS,
    RenderWorkers,
)
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine, running_server

CONTEXT = 131_072


def _conversation(words: int) -> RenderRequest:
    """Several user and assistant turns of ``words`` distinct-ish words in all."""
    turns = 8
    items = tuple(
        Message(role="user" if turn % 2 == 0 else "assistant",
                text=" ".join(f"w{(turn * words + i) % 9973}x" for i in range(words // turns)))
        for turn in range(turns)
    )  # fmt: skip
    return RenderRequest(items=items, instructions="Be brief.")


def _fit_here(render: RenderRequest, context: int = CONTEXT) -> tuple[list[int], RenderRequest]:
    bounds = context_fit.token_bounds(render.items, context)
    return context_fit.fit_context(render, None, context, bounds)


async def _with_ticker(work) -> tuple[object, float]:
    """(work's result, the longest gap between 1 ms ticks of a task beside it)."""
    ticks = [time.perf_counter()]
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    ticker = asyncio.create_task(tick())
    try:
        result = await work
        ticks.append(time.perf_counter())  # the gap since the last tick counts too
    finally:
        done.set()
        await ticker
    return result, max(b - a for a, b in itertools.pairwise(ticks))


def test_api_error_pickles_whole() -> None:
    error = APIError(400, "Too long.", param="input", code="context_length_exceeded")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is APIError and again.body() == error.body()
    assert again.status_code == 400 and str(again) == "Too long."


@pytest.mark.slow
def test_a_worker_renders_what_this_process_does_with_the_loop_free() -> None:
    render = _conversation(25_000)
    started = time.perf_counter()
    expected_ids, expected_render = _fit_here(render)
    here = time.perf_counter() - started
    bounds = context_fit.token_bounds(render.items, CONTEXT)
    workers = RenderWorkers(1)

    async def main() -> tuple:
        await workers.fit_context(_conversation(12_000), None, CONTEXT, [1] * 8)  # start, warm
        return await _with_ticker(workers.fit_context(render, None, CONTEXT, bounds))

    try:
        (ids, fitted), longest_gap = asyncio.run(main())
    finally:
        workers.close()
    assert ids == expected_ids and fitted == expected_render
    # Here the render holds the GIL for all of `here`: ~0.04 s on a CI core once the encoding is
    # loaded (0.039 s in one full run, which failed a bound of 0.04), ~0.2 s with its loading.
    # Beside a worker the loop only waits for the pickles (3-4 ms).
    assert len(ids) > 50_000 and here > 0.02, (len(ids), here)
    assert longest_gap < here / 2, (longest_gap, here)


@pytest.mark.slow
def test_a_refusal_in_the_worker_is_the_same_400() -> None:
    render = _conversation(12_000)
    bounds = context_fit.token_bounds(render.items, 1_000)
    with pytest.raises(APIError) as here:
        context_fit.fit_context(render, None, 1_000, bounds)
    workers = RenderWorkers(1)
    try:
        with pytest.raises(APIError) as there:
            asyncio.run(workers.fit_context(render, None, 1_000, bounds))
    finally:
        workers.close()
    assert there.value.body() == here.value.body()
    assert there.value.status_code == 400


class DeadPool:
    """Its jobs fail once awaited, as those in flight when a worker dies."""

    def submit(self, *args, **kwargs) -> Future:
        failed = Future()
        failed.set_exception(BrokenProcessPool("worker died"))
        return failed

    def shutdown(self, **kwargs) -> None:
        pass


def test_a_dead_pool_is_replaced_and_the_render_done_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    render = _conversation(12_000)  # over RENDER_IN_WORKER_CHARS: for the pool
    assert context_fit.input_chars(render.items) > RENDER_IN_WORKER_CHARS
    workers = RenderWorkers(1)
    for _ in range(MAX_BROKEN_POOLS):
        workers._pool = DeadPool()  # the pool a crash leaves
        ids, fitted = asyncio.run(workers.fit_context(render, None, CONTEXT, [1] * 8))
        assert (ids, fitted) == _fit_here(render)
        assert workers._pool is None  # a fresh one at the next render
    # Two renders on one pool that breaks: it is replaced once, and both are rendered here.
    workers = RenderWorkers(1)
    workers._pool = DeadPool()

    async def both() -> list:
        return await asyncio.gather(*(workers.fit_context(render, None, CONTEXT, [1] * 8)
                                      for _ in range(2)))  # fmt: skip

    assert asyncio.run(both()) == [_fit_here(render)] * 2
    assert workers._broken == 1 and workers._pool is None
    for _ in range(MAX_BROKEN_POOLS - 1):
        workers._pool = DeadPool()
        asyncio.run(workers.fit_context(render, None, CONTEXT, [1] * 8))
    # After MAX_BROKEN_POOLS, no pool is started again: renders stay in this process.
    assert asyncio.run(workers.fit_context(render, None, CONTEXT, [1] * 8)) == _fit_here(render)
    assert workers._pool is None
    with pytest.raises(ValueError, match="processes"):
        RenderWorkers(-1)


def test_zero_processes_or_a_small_input_render_in_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = context_fit.fit_context
    monkeypatch.setattr(context_fit, "fit_context", lambda *a: calls.append(1) or real(*a))
    large, small = _conversation(12_000), _conversation(200)
    assert asyncio.run(RenderWorkers(0).fit_context(large, None, CONTEXT, [1] * 8)) == (
        _fit_here(large)
    )
    workers = RenderWorkers(1)
    assert asyncio.run(workers.fit_context(small, None, CONTEXT, [1] * 8)) == _fit_here(small)
    assert workers._pool is None  # never started for it
    assert len(calls) == 4  # the two renders above and their two checks, all here


@pytest.mark.eager_render_workers
def test_start_spawns_the_workers_and_loads_their_vocabulary() -> None:
    workers = RenderWorkers(1)
    try:
        asyncio.run(workers.start())
        processes = list(workers._pool._processes.values())
        assert len(processes) == 1 and processes[0].is_alive()
    finally:
        workers.close()
    zero = RenderWorkers(0)
    asyncio.run(zero.start())
    assert zero._pool is None
    # A worker that dies starting (a program without a __main__ guard): the server starts,
    # counting a broken pool, and the next large prompt tries a new one.
    dead = RenderWorkers(1)
    dead._pool = DeadPool()
    asyncio.run(dead.start())
    assert dead._pool is None and dead._broken == 1


def test_the_app_starts_its_workers_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first large prompt does not wait for a worker process to start (2-4 s on the GPU
    machine, with every request behind it)."""
    started = []

    async def start(self: RenderWorkers) -> None:
        started.append(self.processes)

    monkeypatch.setattr(RenderWorkers, "start", start)
    app = create_app(ScriptedEngine(), ResponseStore(":memory:"), ServerConfig())
    with running_server(app):
        assert started == [ServerConfig.render_processes]
