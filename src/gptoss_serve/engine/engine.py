"""The engine core: one step is schedule, execute, update.

Owns the scheduler and the model runner, and each request's sampling state: its seed (drawn
here when the request has none, so its tokens are reproducible inside any batch) and its
grammar (grammar_batch.py: every row's token consumed and every row's next mask computed in
one call each, while the forward pass runs on the device). Single-threaded: async_engine.py
drives it from one worker thread.

Async scheduling (``async_scheduling``, on by default): each ``step`` schedules and launches
the next step before it waits for the tokens of the one in flight, so the device runs while
the host reads tokens back, updates the requests and prepares the next inputs (the ~0.17 ms
a 120b batch-1 step left the H200 idle). The tokens are the same: a placeholder row takes
its token on the device, and the seeds and token indices do not depend on the timing. When a
row of the next step has a grammar, whose next mask needs the token just sampled, only its
forward pass goes ahead: the host then reads the tokens in flight, advances the grammars and
launches the sampling with their masks while the device still runs that forward pass (every
API request has a grammar, its reasoning budget's; bench/RESULTS.md e16).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from gptoss_serve.config import SampledToken, SamplingParams
from gptoss_serve.engine.grammar_batch import BatchGrammars
from gptoss_serve.engine.model_runner import (
    ModelRunner,
    PreviousTokens,
    SampledTokens,
    SamplingBatch,
)
from gptoss_serve.engine.request import Request
from gptoss_serve.engine.scheduler import Scheduler
from gptoss_serve.engine.scheduler_output import RequestOutput, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass
class _SamplingState:
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class _Launched:
    """A step queued on the device, its tokens not read back yet."""

    output: SchedulerOutput
    request_ids: tuple[str, ...]  # of the sampled rows
    tokens: SampledTokens | None  # None: no row sampled
    failed: dict[str, str]  # requests whose grammar failed this step

    def previous(self) -> PreviousTokens | None:
        if self.tokens is None:
            return None
        return PreviousTokens(self.request_ids, self.tokens.device)


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    # Requests that failed this step (a grammar that refused or allowed nothing) -> why.
    failed: dict[str, str] = field(default_factory=dict)
    # Requests whose rows this call launched first since their admission or resumption (their
    # prompt's computing began in it; with async scheduling their tokens come a call later).
    started: tuple[str, ...] = ()


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        cache_salt: str = "",
        async_scheduling: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.cache_salt = cache_salt
        self.async_scheduling = async_scheduling
        self._in_flight: _Launched | None = None  # launched by the last step, not read
        self._states: dict[str, _SamplingState] = {}
        self._grammars = BatchGrammars()

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Raises SchedulerError (a request that can never run) or GrammarError."""
        if params.grammar is not None:
            self._grammars.add(request_id, params.grammar)
        request = Request(request_id, prompt_ids, params, cache_salt=self.cache_salt)
        try:
            self.scheduler.add_request(request)
        except Exception:
            self._grammars.remove(request_id)
            raise
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self._states[request_id] = _SamplingState(params, seed)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._drop(request_id)

    def stats(self) -> SchedulerStats:
        """The scheduler's queues, KV cache usage and counters now."""
        return self.scheduler.stats()

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> StepResult:
        """Tokens of one step. With async scheduling the step after it is launched first and
        left in flight for the next call."""
        launched, self._in_flight = self._in_flight, None
        started: list[str] = []
        if launched is None:
            output = self.scheduler.schedule()
            if output.is_empty:
                return StepResult([])
            started += _new_rows(output)
            launched = self._launch(output, None)
        result = None
        if self.async_scheduling:
            ahead = self.scheduler.schedule(ahead=True)
            if not ahead.is_empty:
                started += _new_rows(ahead)
                self._in_flight, result = self._launch_ahead(ahead, launched)
        if result is None:
            result = self._complete(launched)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests:
            self._complete(self._in_flight)  # its rows' requests have all finished
            self._in_flight = None
        return dataclasses.replace(result, started=tuple(started)) if started else result

    def _launch(self, output: SchedulerOutput, previous: PreviousTokens | None) -> _Launched:
        logits, inputs = self.runner.forward(output, previous)
        ids = inputs.sampled_request_ids
        # While the device computes the logits: the rows' sampling values and grammar masks.
        sampling = self._sampling_batch(ids)
        bitmask, failed = self._grammars.bitmask(ids, self.runner.mask_buffer)
        tokens = self.runner.sample_async(logits, sampling, bitmask) if ids else None
        return _Launched(output, ids, tokens, failed)

    def _launch_ahead(
        self, output: SchedulerOutput, launched: _Launched
    ) -> tuple[_Launched, StepResult | None]:
        """Launch ``output`` while ``launched`` is in flight. Rows with a grammar need the mask
        after the token in flight: then only the forward pass is queued before ``launched``
        completes (returned), and the sampling after it, with the masks of the grammars just
        advanced (a request finished or failed meanwhile samples unmasked, its token unused)."""
        logits, inputs = self.runner.forward(output, launched.previous())
        ids = inputs.sampled_request_ids
        sampling = self._sampling_batch(ids)  # before the update: the same draw as in turn
        result = None
        if any(request_id in self._grammars for request_id in ids):
            result = self._complete(launched)
        bitmask, failed = self._grammars.bitmask(ids, self.runner.mask_buffer)
        tokens = self.runner.sample_async(logits, sampling, bitmask) if ids else None
        return _Launched(output, ids, tokens, failed), result

    def _complete(self, launched: _Launched) -> StepResult:
        """Read a launched step's tokens back and update the requests with them."""
        ids, failed = launched.request_ids, launched.failed
        tokens = [] if launched.tokens is None else launched.tokens.tolist()
        if launched.tokens is not None:
            for row, (logprob, top) in launched.tokens.logprobs().items():
                k = self._states[ids[row]].params.logprobs if ids[row] in self._states else 0
                tokens[row] = SampledToken(tokens[row], logprob, tuple(top[:k]))
        sampled = dict(zip(ids, tokens, strict=True))
        # Requests finished or aborted since have left the grammars; failed ones are skipped.
        self._grammars.advance({r: t for r, t in sampled.items() if r not in failed})
        outputs = self.scheduler.update_from_output(launched.output, sampled)
        for result in outputs:
            if result.finish_reason is not None:
                self._drop(result.request_id)
        for request_id in failed:
            self.abort_request(request_id)
        outputs = [o for o in outputs if o.request_id not in failed]
        return StepResult(outputs, failed)

    def _sampling_batch(self, request_ids: Sequence[str]) -> SamplingBatch:
        temperature, top_p, seeds, steps, logprobs = [], [], [], [], []
        for request_id in request_ids:
            state = self._states[request_id]
            temperature.append(state.params.temperature)
            top_p.append(state.params.top_p)
            seeds.append(state.seed)
            steps.append(self.scheduler.requests[request_id].num_output_tokens)
            logprobs.append(state.params.logprobs)
        return SamplingBatch(temperature, top_p, seeds, steps, logprobs)

    def _drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._grammars.remove(request_id)

    def close(self) -> None:
        if self._in_flight is not None:  # let the device finish what it was given
            if self._in_flight.tokens is not None:
                self._in_flight.tokens.tolist()
            self._in_flight = None
        for request_id in list(self._states):
            self._drop(request_id)


def _new_rows(output: SchedulerOutput) -> list[str]:
    return [row.request_id for row in output.scheduled if row.is_new]
