"""The interface between the server and an engine (CPU now, GPU later). No torch here.

An engine takes a prompt (token ids) with sampling parameters and streams back token ids
asynchronously; closing the stream early (a client that went away) aborts the generation.
When the parameters ask for log-probabilities, each token id comes as a
``config.SampledToken``: an int (every consumer of ids takes it as one) that also carries them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.scheduler_output import SchedulerStats


class EngineError(RuntimeError):
    """Generation failed inside the engine; it fails one response, never the server."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str  # the id served under /v1/models
    max_context_tokens: int  # prompt + output must fit
    vocab_size: int
    created_at: int  # unix time the model was loaded (the model object's `created`)


@dataclass(frozen=True)
class FinishedRequest:
    """What an engine reports of a generation read to its end (``EngineClient.finished``)."""

    cached_tokens: int = 0  # prompt tokens from the prefix cache (usage's cached_tokens)
    # Seconds from the request's hand-over to the engine to the start of the step that began
    # computing its prompt (waiting for a place in a step), and from there to its first token
    # (its prompt's computing, in one or more steps, and the first sampling). None: unknown.
    queue_s: float | None = None
    prefill_s: float | None = None


class EngineClient(Protocol):
    info: EngineInfo

    def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[int]:
        """Stream the generated token ids (the last is a stop token unless max_tokens ran
        out), as ``config.SampledToken``s when ``params.logprobs`` is set. Raises EngineError if
        generation fails. Closing the iterator aborts it.

        With ``params.grammar`` set, every token is drawn among those the grammar allows
        (``gptoss_serve.constrain``); a grammar that cannot go on fails the request with
        EngineError, it never hangs."""
        ...

    def finished(self, request_id: str) -> FinishedRequest:
        """Of a generation that ended (its stream was read to the end): its prompt tokens from
        the prefix cache (``usage.input_tokens_details.cached_tokens``; 0 without a prefix
        cache) and how long it waited and prefilled. Empty when the engine does not know the
        request. Reading it forgets it."""
        ...

    def stats(self) -> SchedulerStats | None:
        """The scheduler's state as of its latest step (queues, KV cache usage, preemptions,
        prefix-cache lookups: ``GET /metrics``), or None for an engine without a scheduler."""
        ...

    def failure(self) -> str | None:
        """None while the engine serves; once it has failed for good (its worker died: a
        device that cannot run another step), why. Every generation then ends with
        EngineError at once, and ``GET /health`` answers 503 so that a supervisor restarts the
        server."""
        ...

    async def close(self) -> None:
        """Stop the engine; in-flight generations end with EngineError."""
        ...
