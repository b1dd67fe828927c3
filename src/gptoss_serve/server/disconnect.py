"""A plain (not streamed) request's generation, stopped when its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from fastapi import Request

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: what a left request ends with, never read


async def _client_left(request: Request) -> None:
    """Returns once the client has closed the connection (its body is read already, so the
    next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Coroutine[Any, Any, None], request: Request) -> bool:
    """Run ``work`` to its end (True), or cancel it when the client disconnects first (False):
    a plain request's generation would otherwise run on to max_output_tokens for nobody, and
    an SDK that timed out and retried would have two. Cancelling closes the engine's token
    generator, which aborts the request in the engine."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait((task, left), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (shutdown)
        left.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()  # the generation's own error, if any, goes to the error handlers
    return True
