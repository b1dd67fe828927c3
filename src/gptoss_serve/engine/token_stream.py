"""One request's token stream between an engine's worker thread and the event loop.

The worker posts token ids, then ``DONE`` or an exception, with ``call_soon_threadsafe``; the
event loop reads them with ``tokens()``. Both engines (cpu_engine.py, async_engine.py) use it.
A batched engine posts a whole step's items with ``post_all``: one wake-up of the event loop a
step rather than one a token (each is a write to the loop's self-pipe and a pass of the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.client import EngineError, FinishedRequest

DONE = object()  # end-of-stream marker on a request's queue


@dataclass
class TokenStream:
    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    is_done: bool = False  # the worker posted its last item
    # time.monotonic() when the engine got it, when its prompt's computing began and when its
    # first token was posted (the worker sets the last two, once).
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    first_token_at: float | None = None

    def mark_started(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now

    def mark_token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now

    def finished(self, cached_tokens: int = 0) -> FinishedRequest:
        """What ``EngineClient.finished`` reports of this stream."""
        started, first = self.started_at, self.first_token_at
        if started is None or first is None:
            return FinishedRequest(cached_tokens)
        return FinishedRequest(cached_tokens, started - self.queued_at, first - started)

    @classmethod
    def open(cls, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, **fields):
        """A stream for the running event loop (call from it)."""
        return cls(request_id, list(prompt_ids), params, asyncio.get_running_loop(),
                   asyncio.Queue(), **fields)  # fmt: skip

    def post(self, item: object) -> None:
        """From the worker thread: a token id, DONE, or an exception that ends the stream."""
        post_all([(self, item)])

    async def tokens(self) -> AsyncIterator[int]:
        """The posted token ids until DONE. An EngineError posted is raised as it is; any
        other exception as EngineError("generation failed: ...")."""
        while (item := await self.queue.get()) is not DONE:
            if isinstance(item, EngineError):
                raise item
            if isinstance(item, BaseException):
                raise EngineError(f"generation failed: {item}") from item
            yield item


def post_all(posts: Iterable[tuple[TokenStream, object]]) -> None:
    """From the worker thread: each (stream, item) as ``TokenStream.post``, in order, with one
    ``call_soon_threadsafe`` per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for stream, item in posts:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
