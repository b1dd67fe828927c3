"""A chat request's ``n`` choices: its prepared generation forked n ways, their events merged as
they come.

Each choice is a Responses run of its own (its own response object, stream state and stop
sequences; with a seed, seed + its index, so that the choices differ and the set repeats), so
the checks, the grammar and the engine path are those of a single choice. They start
together: the engine's scheduler admits the first and holds the others back while its prefill
computes their prompt (scheduler._waits_for_pending), so they find it in the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from gptoss_serve.server.objects import new_id
from gptoss_serve.server.responses import Prepared

logger = logging.getLogger(__name__)


def fork(prepared: Prepared, n: int, seed_range: int) -> list[Prepared]:
    """``prepared`` and n - 1 copies of it, each with a response object of its own (a deep
    copy: the runs fill their outputs) and, where a seed is set, the seed + its index."""
    if n > 1 and prepared.lease is not None:  # one conversation lease cannot serve n runs
        raise ValueError("a generation holding a conversation lease cannot be forked")
    choices = [prepared]
    for index in range(1, n):
        response = prepared.response.model_copy(deep=True, update={"id": new_id("resp")})
        params = prepared.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % seed_range)
        choices.append(dataclasses.replace(prepared, response=response, params=params))
    return choices


Run = Callable[[Prepared], AsyncIterator[dict[str, Any]]]
_Item = tuple[int, dict[str, Any] | BaseException | None, asyncio.Event | None]


async def merged(choices: list[Prepared], run: Run) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice index, event) of every choice's run, in the order they come. As with one run
    iterated directly, a run waits at each event until the consumer has taken it and asks for
    the next: its ``stop_when`` then sees what the consumer made of the event (the stop
    sequences matched in the text). A run's own exception is raised here; closing this
    generator (a client that left, a failed choice) cancels the runs still going, which
    aborts their requests in the engine."""
    if len(choices) == 1:  # no tasks, no hand-over: the run itself
        async with contextlib.aclosing(run(choices[0])) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(index, run(choice), queue))
             for index, choice in enumerate(choices)]  # fmt: skip
    running = len(tasks)
    try:
        while running:
            index, event, taken = await queue.get()
            if isinstance(event, BaseException):
                raise event
            if event is None:
                running -= 1
            else:
                yield index, event
                taken.set()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:  # their runs' own clean-up (engine aborts, metrics) before leaving
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _pump(index: int, events: AsyncIterator[dict[str, Any]], queue: asyncio.Queue) -> None:
    """One run's events into the queue, each waited on until taken; then None, or the
    exception that ended the run (which the consumer raises). Closing the run's generator on
    the way out, cancelled or not, runs its clean-up at once (its engine request aborted)
    rather than whenever it is collected."""
    try:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                taken = asyncio.Event()
                await queue.put((index, event, taken))
                await taken.wait()
    except Exception as error:  # passed on to the consumer, which raises it
        await queue.put((index, error, None))
        return
    await queue.put((index, None, None))
