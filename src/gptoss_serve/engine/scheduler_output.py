"""What the scheduler hands to the model runner for one step, and what it hands back after.

Pure Python (no torch), frozen: one step's state is passed, never kept globally.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_serve.engine.block_pool import BLOCK_SIZE


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: ``token_ids`` at positions ``num_computed_tokens`` on."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens to compute this step
    num_computed_tokens: int  # tokens with K/V in the cache before this step
    # Per KV group (0 full, 1 sliding), the whole block table after this step's allocation;
    # sliding entries before the window are -1. Covers every token up to seq_len.
    block_ids: tuple[tuple[int, ...], ...]
    # Per group, the blocks appended this step (all of them when is_new), for a runner that
    # keeps its block tables between steps.
    new_block_ids: tuple[tuple[int, ...], ...]
    # First step since admission or resumption: the runner (re)builds this request's row.
    is_new: bool
    # This step reaches the request's last token: sample the next one from its logits.
    is_sampled: bool
    num_cached_tokens: int = 0  # prefix-cache hit found at this admission (0 unless is_new)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this step's K/V are written (the kernels' seq_lens)."""
        return self.num_computed_tokens + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One query at the end of the sequence: the decode kernel's shape."""
        return len(self.token_ids) == 1

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.seq_len)

    def slot_ids(self, group: int) -> list[int]:
        """Where each new token's K/V go in ``group``'s caches: block * BLOCK_SIZE + offset."""
        table = self.block_ids[group]
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in self.positions]


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    # Decodes first (``num_decodes`` of them), then prefill chunks: the runner runs the decode
    # kernel on a prefix of the batch (padding it to a captured size) and prefill on the rest.
    scheduled: tuple[ScheduledRequest, ...]
    num_decodes: int
    # Sent back to waiting this step (their blocks are gone): the runner drops their rows.
    preempted_request_ids: tuple[str, ...]
    # Finished or aborted since the previous step: the runner drops their rows.
    finished_request_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class RequestOutput:
    """What one step gave one request: its new token, and how it finished if it did."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" or "length" once finished
    num_cached_tokens: int  # prompt tokens found in the prefix cache (usage.cached_tokens)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of full-attention blocks in use
    sliding_kv_usage: float  # same for the sliding-window group (0 without one)
    num_preemptions: int
    num_prefix_queried_tokens: int  # tokens of admitted requests looked up in the prefix cache
    num_prefix_hit_tokens: int
    # Admissions put off a step because a running prefill was computing the request's next
    # prompt block (scheduler._waits_for_pending).
    num_prefix_waits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.num_prefix_queried_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens
