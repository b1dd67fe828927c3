"""Background responses (``background: true``): a generation that outlives its request.

The create call answers at once (``queued``), or streams; either way the generation runs in
a task of the server's event loop, and every event it makes is kept, so that ``GET
/v1/responses/{id}?stream=true&starting_after=N`` replays the events after N and follows the
live ones, a plain ``GET`` sees the object as it grows, ``POST .../cancel`` stops it (status
``cancelled``, stored), and ``DELETE`` stops it and forgets its events with the object.
Finished runs stay replayable until ``keep`` newer ones push them out (in this process only:
a restart keeps the stored objects, not their events).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gptoss_serve.engine.client import EngineClient
from gptoss_serve.server import events
from gptoss_serve.server.metrics import ServerMetrics
from gptoss_serve.server.objects import ResponseError
from gptoss_serve.server.request_ids import current_request_id
from gptoss_serve.server.responses import Prepared, run, store_response
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)


@dataclass
class BackgroundRun:
    prepared: Prepared
    events: list[dict[str, Any]] = field(default_factory=list)  # sequence numbers 0, 1, ...
    done: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task | None = None

    def snapshot(self) -> dict[str, Any]:
        return self.prepared.response.dump()

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events with sequence numbers above ``after``, then each new one until the run
        ends."""
        index = after + 1
        while True:
            async with self.changed:
                while len(self.events) <= index and not self.done:
                    await self.changed.wait()
                batch = self.events[index:]
            for event in batch:
                yield event
            index += len(batch)
            if self.done and index >= len(self.events):
                return

    async def _add(self, new: list[dict[str, Any]], *, done: bool = False) -> None:
        async with self.changed:
            self.events.extend(new)
            self.done = self.done or done
            self.changed.notify_all()


class BackgroundRuns:
    """The process's background runs by response id (running, and the last ``keep`` ended)."""

    def __init__(
        self, engine: EngineClient, store: ResponseStore, metrics: ServerMetrics | None = None,
        keep: int = 64,
    ) -> None:  # fmt: skip
        self._engine = engine
        self._store = store
        self._metrics = metrics
        self._keep = keep
        self._runs: collections.OrderedDict[str, BackgroundRun] = collections.OrderedDict()

    def start(self, prepared: Prepared) -> BackgroundRun:
        """Queue ``prepared`` (its object says ``queued`` until the generation starts)."""
        prepared.response.background = True
        prepared.response.status = "queued"
        background = BackgroundRun(prepared)
        background.task = asyncio.create_task(self._drive(background))
        self._runs[prepared.response.id] = background
        self._forget_old()
        return background

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    async def cancel(self, background: BackgroundRun) -> dict[str, Any]:
        """Stop a run (no-op once it ended); returns the object as it stands."""
        if background.task is not None and not background.task.done():
            background.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background.task
        if background.prepared.lease is not None:  # a run cancelled before it began
            background.prepared.lease.release()
        return background.snapshot()

    async def forget(self, response_id: str) -> None:
        """A deleted response: stop its run if it still goes (stored as cancelled, which the
        caller then deletes) and drop its events, so that nothing serves it any more."""
        background = self._runs.get(response_id)
        if background is not None:
            await self.cancel(background)
            self._runs.pop(response_id, None)

    async def close(self) -> None:
        """Shutdown: cancel what still runs (stored as cancelled)."""
        for background in list(self._runs.values()):
            await self.cancel(background)

    async def _drive(self, background: BackgroundRun) -> None:
        prepared = background.prepared
        prepared.response.status = "in_progress"
        try:
            async for event in run(prepared, self._engine, self._store, self._metrics):
                await background._add([event])
        except asyncio.CancelledError:
            prepared.response.status = "cancelled"
            cut = events.cancel(prepared.state)
            store_response(prepared, self._store)
            logger.info("background response %s cancelled", prepared.response.id)
            await background._add(cut, done=True)
            raise
        except Exception as error:  # a bug, not the client's: logged; the run ends as failed
            logger.exception(
                "background response %s failed (%s)", prepared.response.id, current_request_id.get()
            )  # the creating request's (the task's context)
            prepared.response.status = "failed"
            prepared.response.error = ResponseError(code="server_error", message=str(error))
            store_response(prepared, self._store)
            await background._add([], done=True)
            return
        await background._add([], done=True)

    def _forget_old(self) -> None:
        ended = [key for key, value in self._runs.items() if value.done]
        for key in ended[: max(0, len(ended) - self._keep)]:
            del self._runs[key]
