"""The engine core: one step is schedule, execute, update.

Owns the scheduler and the model runner, and each request's sampling state: its seed (drawn
here when the request has none, so its tokens are reproducible inside any batch) and its
grammar, whose next mask is computed on a thread while the forward pass runs on the device.
Single-threaded: async_engine.py drives it from one worker thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gptoss_serve.config import SamplingParams
from gptoss_serve.constrain.adapter import ConstraintError, num_mask_words
from gptoss_serve.engine.constrained import GrammarConstraint
from gptoss_serve.engine.model_runner import ModelRunner, SamplingBatch
from gptoss_serve.engine.request import Request
from gptoss_serve.engine.scheduler import Scheduler
from gptoss_serve.engine.scheduler_output import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _SamplingState:
    params: SamplingParams
    seed: int
    constraint: GrammarConstraint | None


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    # Requests that failed this step (a grammar that refused or allowed nothing) -> why.
    failed: dict[str, str] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        mask_pool: concurrent.futures.Executor | None = None,
        cache_salt: str = "",
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.cache_salt = cache_salt
        # Masks overlap the forward pass; one thread keeps up (tens of µs per mask).
        self._mask_pool = mask_pool or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="masks"
        )
        self._states: dict[str, _SamplingState] = {}

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Raises SchedulerError (a request that can never run) or GrammarError."""
        constraint = None
        if params.grammar is not None:
            constraint = GrammarConstraint(params.grammar, self._mask_pool)
        request = Request(request_id, prompt_ids, params, cache_salt=self.cache_salt)
        self.scheduler.add_request(request)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self._states[request_id] = _SamplingState(params, seed, constraint)
        if constraint is not None:
            constraint.start()

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._drop(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> StepResult:
        output = self.scheduler.schedule()
        if output.is_empty:
            return StepResult([])
        logits, inputs = self.runner.forward(output)
        ids = inputs.sampled_request_ids
        # While the device computes the logits: the rows' sampling values and grammar masks.
        sampling = self._sampling_batch(ids)
        bitmask, failed = self._bitmasks(ids)
        tokens = self.runner.sample(logits, sampling, bitmask)
        for request_id, token in zip(ids, tokens, strict=True):
            state = self._states[request_id]
            if state.constraint is not None and request_id not in failed:
                state.constraint.advance(token)
        outputs = self.scheduler.update_from_output(output, dict(zip(ids, tokens, strict=True)))
        for result in outputs:
            if result.finish_reason is not None:
                self._drop(result.request_id)
        for request_id in failed:
            self.abort_request(request_id)
        outputs = [o for o in outputs if o.request_id not in failed]
        return StepResult(outputs, failed)

    def _sampling_batch(self, request_ids: Sequence[str]) -> SamplingBatch:
        temperature, top_p, seeds, steps = [], [], [], []
        for request_id in request_ids:
            state = self._states[request_id]
            temperature.append(state.params.temperature)
            top_p.append(state.params.top_p)
            seeds.append(state.seed)
            steps.append(self.scheduler.requests[request_id].num_output_tokens)
        return SamplingBatch(temperature, top_p, seeds, steps)

    def _bitmasks(self, request_ids: Sequence[str]) -> tuple[torch.Tensor | None, dict[str, str]]:
        rows = [self._states[r].constraint for r in request_ids]
        if all(c is None for c in rows):
            return None, {}
        bitmask = torch.full((len(rows), num_mask_words()), -1, dtype=torch.int32)
        failed = {}
        for row, (request_id, constraint) in enumerate(zip(request_ids, rows, strict=True)):
            if constraint is None:
                continue
            try:
                bitmask[row] = constraint.bitmask()
            except ConstraintError as error:  # this request fails; the batch goes on
                logger.warning("request %s: grammar failed: %s", request_id, error)
                failed[request_id] = f"constrained decoding failed: {error}"
        return bitmask, failed

    def _drop(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.constraint is not None:
            state.constraint.cancel()

    def close(self) -> None:
        for request_id in list(self._states):
            self._drop(request_id)
        self._mask_pool.shutdown(wait=True)
