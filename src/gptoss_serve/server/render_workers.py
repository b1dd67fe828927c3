"""Fits and renders large prompts in worker processes, off the server's event loop.

openai-harmony's renderer (Rust, through pyo3) holds the GIL for its whole call: 0.24 s for a
192k-token conversation on one core of the CPU CI machine. Run in the server's process, even
in a worker thread, that call stalls the event loop, and with it every other request's stream,
for as long. So where a render is larger than RENDER_IN_WORKER_CHARS characters
(``context_fit.render_chars``: items, instructions and tools; ~8k tokens of English, ~8 ms to
render), ``context_fit.fit_context`` runs in a process pool, and the event loop
only pickles the conversation and unpickles the token ids: on a CI core, the event loop's
longest stall during a 96,921-token render went from 100 ms to 6.5 ms (30,219 tokens: 32 to
2.8 ms). The app starts the pool before it serves (``start``): the spawned process imports
the server's modules and loads the vocabulary, 2-4 s on the H200 machine, which the first
large prompt used to wait for, with every request behind it (a 4-s TTFT in a tool loop at
the turn whose prompt first passed the threshold); ``processes=0`` renders in the caller
instead.

The workers are started with "spawn", which imports the main module again in the child: a
program that builds the app itself must guard its entry point with ``if __name__ ==
"__main__"`` (the ``gptoss-serve`` command does). A pool whose worker dies is replaced; after
MAX_BROKEN_POOLS of them, large prompts render in the server's process, with an error logged.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import RenderRequest
from gptoss_serve.server import context_fit

logger = logging.getLogger(__name__)

MAX_BROKEN_POOLS = 3
RENDER_IN_WORKER_CHARS = 1 << 15  # smaller inputs render in the caller (a few ms at most)


class RenderWorkers:
    """``fit_context`` in up to ``processes`` worker processes (0: in the caller)."""

    def __init__(self, processes: int) -> None:
        if processes < 0:
            raise ValueError(f"processes must be >= 0, got {processes}")
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._broken = 0  # pools whose worker died

    async def start(self) -> None:
        """Start the worker processes, one vocabulary load given to the pool per process (a
        no-op with none; with several, the pool may give two loads to one of them).
        A worker that dies starting (a program that builds the app without a ``__main__``
        guard: the spawn runs it again) counts as a broken pool; the server serves on."""
        if not self.processes or self._broken >= MAX_BROKEN_POOLS:
            return
        pool, loop = self._started_pool(), asyncio.get_running_loop()
        try:
            await asyncio.gather(
                *(loop.run_in_executor(pool, _load_vocabulary) for _ in range(self.processes))
            )
        except BrokenProcessPool:
            self._pool_broke(pool, "did not start (does the program that builds the app guard "
                             "its entry point with `if __name__ == '__main__'`?)")  # fmt: skip

    def _started_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork of a process that holds CUDA, threads and an event loop is unsafe.
            context_of = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=context_of, initializer=_ignore_interrupts
            )
        return self._pool

    async def fit_context(
        self, render: RenderRequest, truncation: str | None, context: int, bounds: Sequence[int]
    ) -> tuple[list[int], RenderRequest]:
        """``context_fit.fit_context`` of these arguments: in a worker process for a render of
        more than RENDER_IN_WORKER_CHARS characters (``context_fit.render_chars``), its
        APIError (a 400) coming back as raised there; else here. If the worker dies, the pool
        is replaced and this one render runs here."""
        here = not self.processes or self._broken >= MAX_BROKEN_POOLS
        if here or context_fit.render_chars(render) <= RENDER_IN_WORKER_CHARS:
            return context_fit.fit_context(render, truncation, context, bounds)
        pool, loop = self._started_pool(), asyncio.get_running_loop()
        job = (render, truncation, context, list(bounds))
        try:
            return await loop.run_in_executor(pool, context_fit.fit_context, *job)
        except BrokenProcessPool:
            self._pool_broke(pool, "died")
            return context_fit.fit_context(*job)

    def _pool_broke(self, pool: ProcessPoolExecutor, what: str) -> None:
        """Count and replace a pool whose worker died (once, for the first of the calls it
        broke), with the error logged; large prompts render in the server meanwhile."""
        if pool is not self._pool:
            return
        self._broken += 1
        logger.exception(
            "the render worker %s (%d of %d); rendering in the server%s",
            what, self._broken, MAX_BROKEN_POOLS,
            ", from now on" if self._broken >= MAX_BROKEN_POOLS else " meanwhile",
        )  # fmt: skip
        pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def close(self) -> None:
        """Stops the worker processes, waiting for a render in flight (a fraction of a
        second: without the wait the pool's semaphores outlive it, which the interpreter's
        exit reports as leaked)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _load_vocabulary() -> None:
    """In a worker: what its first render would otherwise load."""
    adapter.encoding()


def _ignore_interrupts() -> None:
    """In a worker: Ctrl-C reaches the whole process group, and the server stops its workers
    itself (``close``); without this each idle worker would print a KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
