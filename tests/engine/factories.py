"""Small factories for the scheduler tests, a fake model over a simulated paged KV cache, and
the invariants every step must keep; a tiny real model and paged cache for the forward pass's
tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptoss_serve.checkpoint.presets import preset_config
from gptoss_serve.config import ModelConfig, SamplingParams, SchedulerConfig
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.kv_cache import KvCacheTensors, allocate_kv_cache
from gptoss_serve.engine.kv_manager import NO_BLOCK, SLIDING_GROUP, KvCacheManager
from gptoss_serve.engine.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from gptoss_serve.engine.scheduler import Scheduler
from gptoss_serve.engine.scheduler_output import (
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from gptoss_serve.engine.synthetic_weights import synthetic_weights
from gptoss_serve.engine.weights import ModelWeights

STOP = 0  # the fake model's stop token


def make_request(
    request_id: str,
    prompt: Sequence[int] | int = 20,
    *,
    max_tokens: int = 8,
    stop_token_ids: tuple[int, ...] = (),
    cache_salt: str = "",
) -> Request:
    """``prompt`` is token ids, or a length (tokens 1000.. derived from the id, so distinct
    requests share no prefix)."""
    if isinstance(prompt, int):
        base = 1000 + 97 * (sum(map(ord, request_id)) % 500)
        prompt = [base + i for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    return Request(request_id, prompt, params, cache_salt=cache_salt)


def make_scheduler(
    *,
    num_full_blocks: int = 64,
    num_sliding_blocks: int | None = 64,
    window: int = 32,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_chunk_tokens: int | None = None,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    """``num_sliding_blocks=None``: no sliding group (every layer full attention)."""
    kv = KvCacheManager(
        num_full_blocks,
        num_sliding_blocks or 0,
        sliding_window=None if num_sliding_blocks is None else window,
        enable_prefix_caching=enable_prefix_caching,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_chunk_tokens=max_chunk_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Scheduler(config, kv)


class FakeModel:
    """Plays the runner over a simulated paged cache. Each step first writes every new
    token's "K/V" (a fingerprint of the sequence up to it) into its slot in every group, then
    checks that every key each query can see holds the fingerprint of the querying sequence at
    that position (full layers: all earlier keys; sliding: the window), and "samples" a token
    that depends on the whole sequence. So a wrong block table, a prefix hit on wrong content
    or an overwritten shared block fails, and recompute must give the same tokens."""

    def __init__(self, scheduler: Scheduler, vocab: int = 50) -> None:
        self.scheduler = scheduler
        self.vocab = vocab
        self.slots: list[dict[int, int]] = [{} for _ in scheduler.kv.pools]
        self.tokens_seen: dict[str, dict[int, int]] = {}  # request -> position -> token computed

    def execute(
        self, output: SchedulerOutput, previous: dict[str, int] | None = None
    ) -> dict[str, int]:
        """``previous``: the tokens sampled by the step before, still in flight (async
        scheduling): a placeholder row takes its request's token from there, as the runner
        does on the device."""
        written: set[tuple[int, int]] = set()
        fingerprints = {}
        for entry in output.scheduled:
            request = self.scheduler.requests[entry.request_id]
            tokens = request.all_token_ids
            start = entry.num_computed_tokens
            assert list(entry.token_ids) == tokens[start : entry.seq_len]
            if request.has_placeholder:
                assert entry.is_decode and entry.seq_len == request.num_tokens
                assert previous is not None and entry.request_id in previous
                tokens = [*tokens[:-1], previous[entry.request_id]]
            assert PLACEHOLDER_TOKEN not in tokens[: entry.seq_len]
            seen = self.tokens_seen.setdefault(entry.request_id, {})
            for position, token in zip(entry.positions, tokens[start : entry.seq_len],
                                       strict=True):  # fmt: skip
                assert seen.setdefault(position, token) == token, "recompute changed a token"
            prints = fingerprints[entry.request_id] = _fingerprints(tokens[: entry.seq_len])
            for group, slots in enumerate(self.slots):
                for position, slot in zip(entry.positions, entry.slot_ids(group), strict=True):
                    assert slot >= 0 and (group, slot) not in written, "slot written twice"
                    written.add((group, slot))
                    slots[slot] = prints[position]
        sampled = {}
        for entry in output.scheduled:
            prints = fingerprints[entry.request_id]
            self._check_visible_keys(entry.block_ids, entry.positions, prints)
            if entry.is_sampled:
                sampled[entry.request_id] = prints[entry.seq_len - 1] % self.vocab
        return sampled

    def _check_visible_keys(
        self, block_ids: tuple[tuple[int, ...], ...], positions: range, prints: list[int]
    ) -> None:
        window = self.scheduler.kv.sliding_window
        for group, slots in enumerate(self.slots):
            first = 0
            if group == SLIDING_GROUP:
                first = max(0, positions[0] - window + 1)  # the first query's window
            for key in range(first, positions[-1] + 1):
                block = block_ids[group][key // BLOCK_SIZE]
                assert block != NO_BLOCK, f"group {group}: key {key} needed but freed"
                slot = block * BLOCK_SIZE + key % BLOCK_SIZE
                assert slots.get(slot) == prints[key], f"group {group}: wrong K/V at key {key}"


def _fingerprints(tokens: Sequence[int]) -> list[int]:
    prints, current = [], 17
    for token in tokens:
        current = hash((current, token)) & 0xFFFFFFFF
        prints.append(current)
    return prints


def step(
    scheduler: Scheduler, model: FakeModel | None = None, token: int = 7
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """One engine step; without a model every sampled token is ``token``."""
    output = scheduler.schedule()
    if model is not None:
        sampled = model.execute(output)
    else:
        sampled = {s.request_id: token for s in output.scheduled if s.is_sampled}
    return output, scheduler.update_from_output(output, sampled)


class AheadDriver:
    """Steps a scheduler the way the engine does with async scheduling: each step schedules
    and "launches" the next one before the running one's tokens are read back."""

    def __init__(self, scheduler: Scheduler, model: FakeModel | None = None, token: int = 7):
        self.scheduler = scheduler
        self.model = model
        self.token = token
        self.launched: tuple[SchedulerOutput, dict[str, int]] | None = None

    def _execute(self, output: SchedulerOutput, previous: dict[str, int] | None):
        if self.model is not None:
            return self.model.execute(output, previous)
        return {s.request_id: self.token for s in output.scheduled if s.is_sampled}

    def step(self) -> tuple[SchedulerOutput | None, list[RequestOutput]]:
        """(the step whose tokens were read back, what it gave)."""
        if self.launched is None:
            output = self.scheduler.schedule()
            if output.is_empty:
                return None, []
            self.launched = (output, self._execute(output, None))
        output, sampled = self.launched
        ahead = self.scheduler.schedule(ahead=True)
        self.launched = None if ahead.is_empty else (ahead, self._execute(ahead, sampled))
        results = self.scheduler.update_from_output(output, sampled)
        if self.launched is not None and not self.scheduler.has_unfinished_requests:
            self.scheduler.update_from_output(*self.launched)  # rows of finished requests only
            self.launched = None
        return output, results

    @property
    def in_flight(self) -> SchedulerOutput | None:
        return None if self.launched is None else self.launched[0]


def run_to_completion(
    scheduler: Scheduler, model: FakeModel, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Step until no request is left; returns every request's streamed tokens."""
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return streamed
        _, results = step(scheduler, model)
        for result in results:
            streamed.setdefault(result.request_id, []).extend(result.new_token_ids)
        check_invariants(scheduler)
    raise AssertionError("requests did not finish")


def check_invariants(scheduler: Scheduler, in_flight: SchedulerOutput | None = None) -> None:
    """Between steps: block ownership, reference counts and free counts add up.
    ``in_flight``: a step scheduled ahead and not updated yet (its blocks are allocated)."""
    kv = scheduler.kv
    pending = {} if in_flight is None else {s.request_id: s.num_new_tokens
                                             for s in in_flight.scheduled}  # fmt: skip
    for group, pool in enumerate(kv.pools):
        owners: dict[int, int] = {}
        for request in scheduler.running:
            for block in request.block_ids[group]:
                if block != NO_BLOCK:
                    owners[block] = owners.get(block, 0) + 1
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == owners.get(block, 0), (group, block)
        assert pool.num_free_blocks + len(owners) == pool.num_blocks
        assert pool.num_free_blocks == sum(1 for c in pool.ref_counts if c == 0)
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert 0 <= request.num_computed_tokens < request.num_tokens
        assert not request.has_placeholder
        written = request.num_computed_tokens + pending.get(request.request_id, 0)
        num_blocks = -(-written // BLOCK_SIZE)
        full = request.block_ids[0]
        assert len(full) == num_blocks and NO_BLOCK not in full
        # A block still to be written (holding the next token) is private and unregistered.
        if written % BLOCK_SIZE:
            for pool, table in zip(kv.pools, request.block_ids, strict=True):
                block = table[-1]
                assert pool.ref_counts[block] == 1 and pool.block_hash(block) is None
        if kv.has_sliding_group:
            sliding = request.block_ids[SLIDING_GROUP]
            first = kv.window_start_block(request.num_computed_tokens)
            assert len(sliding) == num_blocks
            assert all(b == NO_BLOCK for b in sliding[:first])
            assert NO_BLOCK not in sliding[first:]
    for request in scheduler.waiting:
        assert request.block_ids == [] and request.num_computed_tokens == 0
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert set(scheduler.requests) == {
        r.request_id for r in [*scheduler.running, *scheduler.waiting]
    }


def decode_step(step: int, contexts: list[int]) -> SchedulerOutput:
    """An all-decode step (the input batch tests): one decode per context length; request i
    owns blocks 100·i + j of both groups."""
    scheduled = tuple(
        ScheduledRequest(
            request_id=f"r{i}",
            token_ids=(7 * step + i,),
            num_computed_tokens=context,
            block_ids=(tuple(range(100 * i, 100 * i + context // BLOCK_SIZE + 1)),) * 2,
            new_block_ids=((), ()),
            is_new=False,
            is_sampled=True,
        )
        for i, context in enumerate(contexts)
    )
    return SchedulerOutput(
        step=step, scheduled=scheduled, num_decodes=len(scheduled), preempted_request_ids=(),
        finished_request_ids=(),
    )  # fmt: skip


def tiny_model(
    num_blocks: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **shape: int,
) -> tuple[ModelConfig, ModelWeights, KvCacheTensors]:
    """Random weights of the tiny preset (``shape``: its overrides; hidden 64, intermediate 64
    and 8 experts if none) and a paged KV cache of ``num_blocks`` blocks in each group."""
    overrides = shape or {"hidden": 64, "intermediate": 64, "experts": 8}
    config = ModelConfig.from_dict(preset_config("tiny", **overrides))
    weights = synthetic_weights(config, device=device, dtype=dtype)
    kv = allocate_kv_cache(config, num_full_blocks=num_blocks, num_sliding_blocks=num_blocks,
                           device=device, dtype=dtype)  # fmt: skip
    return config, weights, kv
