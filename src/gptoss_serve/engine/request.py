"""One request as the scheduler sees it: its tokens, its progress and its KV blocks.

Pure Python (no torch). A request's tokens are its prompt followed by what it generated;
``num_computed_tokens`` of them have their K/V in the paged cache. Between steps every running
request has at least one token still to compute: the last sampled one (a decode), or the rest
of its prompt (a prefill, possibly chunked over several steps). A preempted request loses its
blocks and computes all its tokens again (recompute), so its token sequence never changes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from gptoss_serve.config import SamplingParams

# A sampled token not read back from the device yet (async scheduling: the next step is
# scheduled while this one runs). The scheduler counts it, the runner feeds the row the token
# the device sampled, and ``update_from_output`` writes the real id in its place.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks taken back; recomputes on resumption
    FINISHED_STOPPED = "finished_stopped"  # sampled a stop token (which is emitted)
    FINISHED_LENGTH = "finished_length"  # max_tokens reached, or the context is full
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" once finished, else None."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Mutable per-request state, owned by the scheduler (the engine reads it, never writes)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.params = params
        # Namespaces the prefix cache (a model or adapter id): equal tokens, other salt: no hit.
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        # prompt + output; kept as one list so chunking and recompute slice a single sequence.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens of the prompt found in the prefix cache at (the latest) admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Physical block ids per KV group (0: full attention, 1: sliding window), one entry per
        # logical block of 16 tokens; -1 marks a sliding block freed for lying before the window.
        self.block_ids: list[list[int]] = []
        # Bumped by the KV manager whenever it changes block_ids (frozen_block_ids' cache key).
        self.tables_version = 0
        self._frozen_tables: tuple[int, tuple[tuple[int, ...], ...]] | None = None
        # Chained hashes of the full blocks of all_token_ids, filled lazily (block_pool).
        self.block_hashes: list[bytes] = []
        # Leading blocks already registered in the prefix cache (kv_manager's bookkeeping).
        self.num_registered_blocks = 0

    def frozen_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """``block_ids`` as tuples (what a step's output carries), rebuilt only after the KV
        manager changed them (``tables_version``): copying every table at every step took the
        scheduler 60 -> 23 ms a step at 1000 decodes of 8k tokens (a CPU, bench/RESULTS.md
        e25), since a decode's tables change once in 16 tokens."""
        if self._frozen_tables is None or self._frozen_tables[0] != self.tables_version:
            frozen = tuple(tuple(table) for table in self.block_ids)
            self._frozen_tables = (self.tables_version, frozen)
        return self._frozen_tables[1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def has_placeholder(self) -> bool:
        """Whether the last token is a sampled one not known on the host yet."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER_TOKEN

    def append_output_token(self, token_id: int) -> None:
        token_id = int(token_id)  # a SampledToken's log-probabilities go out, not stay here
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def resolve_placeholder(self, token_id: int) -> None:
        """The sampled token behind the trailing ``PLACEHOLDER_TOKEN``."""
        if not self.has_placeholder:
            raise RuntimeError(f"request {self.request_id} has no token to resolve")
        token_id = int(token_id)
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
