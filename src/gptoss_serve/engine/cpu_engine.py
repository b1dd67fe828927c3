"""The CPU engine: the plain-torch model in a worker thread, several requests interleaved.

Requests are not batched (the plain-torch model runs one sequence per call); instead the
worker round-robins: each pass runs one prefill chunk (model/generate.py's PREFILL_CHUNK
tokens) of every request still prefilling and decodes one token for every other active one,
so concurrent requests all make progress, and a request cancelled mid-prefill (its client
went away) stops at its next chunk. The event loop never runs the model: tokens cross back
to it with ``call_soon_threadsafe``.

A request with a grammar (``params.grammar``) samples under its mask; the next mask is
computed on a mask thread while the model runs the request's forward pass (constrained.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.client import EngineError, EngineInfo, FinishedRequest
from gptoss_serve.engine.constrained import GrammarConstraint
from gptoss_serve.engine.token_stream import DONE, TokenStream
from gptoss_serve.model.generate import Generation
from gptoss_serve.model.transformer import GptOssForCausalLM

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # finished jobs whose times nobody asked for


@dataclass
class _Job(TokenStream):
    generation: Generation | None = None
    constraint: GrammarConstraint | None = None
    is_cancelled: bool = False


class CpuEngine:
    """An ``EngineClient`` over the plain-torch model (CPU or a single CUDA device)."""

    def __init__(
        self, model: GptOssForCausalLM, model_name: str, *, max_active: int = 8,
        max_context_tokens: int | None = None,
    ) -> None:  # fmt: skip
        """``max_context_tokens``: prompt + output of one request (`--max-model-len`), at most
        the model's context (the default)."""
        self.model = model
        context = model.config.max_position_embeddings
        self.info = EngineInfo(
            model_name=model_name,
            max_context_tokens=min(context, max_context_tokens or context),
            vocab_size=model.config.vocab_size,
            created_at=int(time.time()),
        )
        self.max_active = max_active
        self._condition = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._active: list[_Job] = []
        self._is_stopped = False
        self._failure: str | None = None  # why the worker died, once it has (a bug)
        # Jobs read to the end (their times), until the caller asks (event loop).
        self._finished: collections.OrderedDict[str, FinishedRequest] = collections.OrderedDict()
        # Mask computations overlap the forward passes; one worker thread keeps up (a mask
        # takes tens of microseconds, a forward pass milliseconds).
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._thread = threading.Thread(target=self._run, name="cpu-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[int]:
        room = self.info.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens does not fit the context "
                              f"({self.info.max_context_tokens})")  # fmt: skip
        if params.max_tokens > room:  # the output stops where the context ends
            params = dataclasses.replace(params, max_tokens=room)
        job = _Job.open(request_id, prompt_ids, params)
        with self._condition:
            if self._is_stopped:
                raise EngineError(self._failure or "the engine is shut down")
            self._pending.append(job)
            self._condition.notify()
        try:
            async for token in job.tokens():
                yield token
            self._finished[request_id] = job.finished()
            while len(self._finished) > _MAX_REMEMBERED:  # callers that never asked
                self._finished.popitem(last=False)
        finally:
            if not job.is_done:  # the consumer went away (client disconnect): abort
                job.is_cancelled = True
                logger.info("request %s aborted", request_id)

    def finished(self, request_id: str) -> FinishedRequest:
        """No prefix cache (every prompt is computed): the times alone."""
        return self._finished.pop(request_id, None) or FinishedRequest()

    def stats(self) -> None:
        """No scheduler: the CPU engine decodes its requests in turn."""
        return None

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
        except Exception as error:  # a request's own errors stay in _step: this is fatal
            logger.exception("the engine failed; every request now ends with an error")
            reason = f"the engine failed: {type(error).__name__}: {error}"
            with self._condition:  # no request queues after this
                self._failure = reason
                self._is_stopped = True
                jobs, self._pending = [*self._active, *self._pending], deque()
            for job in jobs:
                job.is_done = True
                job.post(EngineError(reason))
            self._active.clear()
            self._mask_pool.shutdown(wait=False)

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not (self._pending or self._active or self._is_stopped):
                    self._condition.wait()
                if self._is_stopped:
                    break
                while self._pending and len(self._active) < self.max_active:
                    self._active.append(self._pending.popleft())
            for job in list(self._active):
                self._step(job)
        for job in [*self._active, *self._pending]:
            job.post(EngineError("generation failed: the engine shut down"))
        self._mask_pool.shutdown(wait=True)

    def _step(self, job: _Job) -> None:
        if job.is_cancelled:
            self._finish(job, None)
            return
        try:
            if job.generation is None:
                job.mark_started(time.monotonic())
                if job.params.grammar is not None:
                    job.constraint = GrammarConstraint(job.params.grammar, self._mask_pool)
                job.generation = Generation(self.model, job.prompt_ids, job.params, job.constraint)
            if job.generation.is_prefilling:
                job.generation.prefill_step()  # the other jobs run between the chunks
                return
            token = job.generation.step()
        except Exception as error:  # one request fails; the engine and the others go on
            logger.exception("request %s failed", job.request_id)
            self._finish(job, error)
            return
        if token is not None:
            job.mark_token(time.monotonic())
            job.post(token)
        if token is None or job.generation.is_finished:
            self._finish(job, DONE)

    def _finish(self, job: _Job, item: object) -> None:
        if job.constraint is not None:
            job.constraint.cancel()
        job.is_done = True
        if item is not None:
            job.post(item)
        self._active.remove(job)
