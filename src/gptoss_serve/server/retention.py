"""Stored responses expire: ``ServerConfig.store_retention_s`` after they were created (30 days
by default, as the official API keeps them; ``--store-retention-days``), so that a server
running for months does not fill its disk with every conversation it ever served. An expired
response is gone as a deleted one is: a 404, also as a ``previous_response_id`` (the responses
that continue it keep their conversations: store.py).

The pruning runs at start-up and then every ``store_prune_interval_s``, in a thread (a large
backlog takes a while; the store lets other calls in between its batches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator

from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger(__name__)


def prune_expired(store: ResponseStore, retention_s: int) -> int:
    """Delete the responses older than ``retention_s``; how many went."""
    cutoff = int(time.time()) - retention_s
    deleted = store.prune(cutoff)
    if deleted:
        logger.info("pruned %d stored responses older than %d s", deleted, retention_s)
    return deleted


async def prune_forever(store: ResponseStore, retention_s: int, interval_s: float) -> None:
    """Prune now, then every ``interval_s``, until cancelled. A failed pass (a full or
    read-only disk) is logged and tried again at the next one: serving goes on."""
    while True:
        try:
            await asyncio.to_thread(prune_expired, store, retention_s)
        except sqlite3.Error:
            logger.exception("pruning the response store failed; next try in %.0f s", interval_s)
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def pruning(store: ResponseStore, retention_s: int, interval_s: float) -> AsyncIterator[None]:
    """``prune_forever`` beside the block (the server's life), stopped when it ends; nothing
    when ``retention_s`` is 0 (kept for ever)."""
    if not retention_s:
        yield
        return
    task = asyncio.create_task(prune_forever(store, retention_s, interval_s))
    task.add_done_callback(_report)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _report(task: asyncio.Task) -> None:
    """A pruning task that died of anything but its cancellation is logged when it dies."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("the response store's pruning stopped", exc_info=task.exception())
