"""The asynchronous engine the server talks to (an ``EngineClient``): the engine core runs on
one worker thread, step after step while any request is unfinished; the event loop only
queues requests and receives tokens (``call_soon_threadsafe``, once a step for all of them).

A request that can never run, or whose grammar fails, ends with EngineError; a step that
raises fails every request in flight and the engine goes on with new ones, on a fresh core. If
even that cannot be built (a sticky CUDA error leaves the device unusable), the engine has
failed for good: every request in flight and every new one ends with EngineError at once
(they would otherwise wait for ever) and ``failure()`` says why (``GET /health``: 503).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.client import EngineError, EngineInfo, FinishedRequest
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.scheduler_output import SchedulerStats
from gptoss_serve.engine.token_stream import DONE, TokenStream, post_all

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096


@dataclass
class _Stream(TokenStream):
    num_cached_tokens: int = 0  # set by the worker from the first output, read after DONE


class AsyncEngine:
    """``make_core`` builds a fresh EngineCore (used at start and after a failed step)."""

    def __init__(self, make_core: Callable[[], EngineCore], info: EngineInfo) -> None:
        self.info = info
        self._make_core = make_core
        self._core = make_core()
        self._condition = threading.Condition()
        self._pending: deque[_Stream] = deque()
        self._aborted: set[str] = set()
        self._streams: dict[str, _Stream] = {}  # admitted to the core, worker-thread only
        # Streams read to the end (prefix-cache hits, times), until the caller asks (event loop).
        self._finished: collections.OrderedDict[str, FinishedRequest] = collections.OrderedDict()
        self._is_stopped = False
        self._failure: str | None = None  # why the worker died, once it has
        # Written by the worker after each step (before its tokens go out) and each round, read
        # by the event loop (a reference swap).
        # _retired: the counters of cores replaced after a failed step, so totals never drop.
        self._retired: _Counters = (0, 0, 0)
        self._stats = self._core.stats()
        self._thread = threading.Thread(target=self._run, name="gpu-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[int]:
        stream = _Stream.open(request_id, prompt_ids, params)
        with self._condition:
            if self._is_stopped:
                raise EngineError(self._failure or "the engine is shut down")
            self._pending.append(stream)
            self._condition.notify()
        try:
            async for token in stream.tokens():
                yield token
            self._finished[request_id] = stream.finished(stream.num_cached_tokens)
            while len(self._finished) > _MAX_REMEMBERED:  # callers that never asked
                self._finished.popitem(last=False)
        finally:
            if not stream.is_done:  # the consumer went away (client disconnect): abort
                with self._condition:
                    self._aborted.add(request_id)
                    self._condition.notify()
                logger.info("request %s aborted", request_id)

    def finished(self, request_id: str) -> FinishedRequest:
        return self._finished.pop(request_id, None) or FinishedRequest()

    def stats(self) -> SchedulerStats:
        return self._stats

    def failure(self) -> str | None:
        return self._failure

    async def close(self) -> None:
        with self._condition:
            self._is_stopped = True
            self._condition.notify()
        await asyncio.to_thread(self._thread.join)

    # -- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:  # not one step's failure (_step handles those): fatal
            logger.exception("the engine failed; every request now ends with an error")
            self._fail_for_good(f"the engine failed: {type(error).__name__}: {error}")

    def _fail_for_good(self, reason: str) -> None:
        with self._condition:  # no request queues after this
            self._failure = reason
            self._is_stopped = True
            pending, self._pending = list(self._pending), deque()
        for stream in [*self._streams.values(), *pending]:
            self._finish(stream, EngineError(reason))
        self._streams.clear()

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not (self._pending or self._aborted or self._streams or self._is_stopped):
                    self._condition.wait()
                if self._is_stopped:
                    break
                pending, self._pending = list(self._pending), deque()
                aborted, self._aborted = self._aborted, set()
            for stream in pending:
                self._admit(stream)
            for request_id in aborted:
                if self._streams.pop(request_id, None) is not None:
                    self._core.abort_request(request_id)
            if self._streams:
                self._step()
            self._stats = self._totals(self._core.stats())
        for stream in [*self._streams.values(), *self._pending]:
            self._finish(stream, EngineError("the engine shut down"))
        self._core.close()

    def _admit(self, stream: _Stream) -> None:
        try:
            self._core.add_request(stream.request_id, stream.prompt_ids, stream.params)
        except ValueError as error:  # SchedulerError, GrammarError: this request only
            self._finish(stream, EngineError(str(error)))
            return
        self._streams[stream.request_id] = stream

    def _step(self) -> None:
        launched_at = time.monotonic()
        try:
            result = self._core.step()
        except Exception as error:  # a failed step fails every request in it, not the server
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            for stream in list(self._streams.values()):
                self._finish(stream, EngineError(f"generation failed: {error}"))
            self._streams.clear()
            self._retired = _add(self._retired, _counters(self._core.stats()))
            self._core.close()
            self._core = self._make_core()
            return
        posts: list[tuple[_Stream, object]] = []  # delivered together: one loop wake-up
        for request_id in result.started:
            if (stream := self._streams.get(request_id)) is not None:
                stream.mark_started(launched_at)
        now = time.monotonic()
        for output in result.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.new_token_ids:
                stream.mark_token(now)
            stream.num_cached_tokens = max(stream.num_cached_tokens, output.num_cached_tokens)
            posts.extend((stream, token) for token in output.new_token_ids)
            if output.finish_reason is not None:
                del self._streams[output.request_id]
                posts.append(_ending(stream, DONE))
        for request_id, reason in result.failed.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                posts.append(_ending(stream, EngineError(reason)))
        # The step's stats before its tokens: a client that has its last token then reads
        # the scheduler after that step (the round's end would come after the loop ran).
        self._stats = self._totals(self._core.stats())
        post_all(posts)

    def _finish(self, stream: _Stream, item: object) -> None:
        post_all([_ending(stream, item)])

    def _totals(self, stats: SchedulerStats) -> SchedulerStats:
        preemptions, queried, hit = _add(self._retired, _counters(stats))
        return replace(stats, num_preemptions=preemptions, num_prefix_queried_tokens=queried,
                       num_prefix_hit_tokens=hit)  # fmt: skip


_Counters = tuple[int, int, int]


def _counters(stats: SchedulerStats) -> _Counters:
    """The cumulative fields of a scheduler's stats."""
    return stats.num_preemptions, stats.num_prefix_queried_tokens, stats.num_prefix_hit_tokens


def _add(a: _Counters, b: _Counters) -> _Counters:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _ending(stream: _Stream, item: object) -> tuple[_Stream, object]:
    """``stream``'s last post (DONE or an error), the stream marked done."""
    stream.is_done = True
    return stream, item
