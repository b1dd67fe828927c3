"""Continuous batching: which requests compute which tokens in the next step.

Pure Python (no torch). One step is ``schedule()`` -> the runner computes the returned
``SchedulerOutput`` -> ``update_from_output()`` with the sampled tokens. The policy follows
vLLM v1:

1. Running requests first, within the step's token budget: decodes (one token each) before
   continuing partial prefills, each chunk at most ``chunk_tokens`` long.
2. A running request that cannot get its blocks preempts the most recently admitted running
   request (possibly itself): that one's blocks are freed, and it goes to the front of the
   waiting queue to recompute its prompt and generated tokens later (its freed full blocks
   stay in the prefix cache, so the recompute is often mostly a cache hit).
3. Then, unless a preemption happened this step, waiting requests are admitted in order
   (first come, first served) while seats (``max_num_seqs``), budget and blocks last: the
   prefix cache is looked up first and only the rest of the prompt is prefilled, in chunks.
   A request whose next prompt blocks a running prefill is computing (most of what it would
   compute) is passed over, keeping its place, until they are cached (``_waits_for_pending``):
   requests that arrive together with one prompt compute it once.

A request that could never fit (prompt at or past the context limit, or more blocks than
the whole pool) is refused by ``add_request``, so the queue never deadlocks: a lone request
always gets every block.

Async scheduling (``schedule(ahead=True)``, one step in flight): the next step is scheduled
before the running one's tokens are read back. The running step's tokens are counted as
computed then, each of its sampled requests gets a ``PLACEHOLDER_TOKEN`` (its decode row
takes the token from the device), and ``update_from_output`` of the running step writes the
real tokens in their place. A request that reaches max_tokens or the context limit with the
placeholder is not scheduled again; one that samples a stop token has one row computed in
vain. Every step runs on the device after the one before it, so blocks freed while a step is
in flight are written again only by later steps.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from gptoss_serve.config import SchedulerConfig
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.kv_manager import (
    FULL_GROUP,
    SLIDING_GROUP,
    CachedPrefix,
    KvCacheManager,
    cdiv,
    sliding_blocks_bound,
)
from gptoss_serve.engine.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from gptoss_serve.engine.scheduler_output import (
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class SchedulerError(ValueError):
    """A request the scheduler refuses (the message says why); other requests go on."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KvCacheManager) -> None:
        if kv.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("the KV manager and the config disagree on prefix caching")
        if kv.has_sliding_group:
            needed = sliding_blocks_bound(kv.sliding_window, config.chunk_tokens)
            if kv.pools[SLIDING_GROUP].num_blocks < needed:
                raise ValueError(
                    f"the sliding-window pool has {kv.pools[SLIDING_GROUP].num_blocks} blocks; "
                    f"one chunk of {config.chunk_tokens} tokens needs {needed}"
                )
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self._finished_ids: list[str] = []  # since the previous step
        # Scheduled, not yet updated: the oldest first; two with async scheduling.
        self._in_flight: deque[SchedulerOutput] = deque()
        self._counted: SchedulerOutput | None = None  # in flight, its tokens counted ahead
        self._step = 0
        self._num_preemptions = 0
        self._num_prefix_queried_tokens = 0
        self._num_prefix_hit_tokens = 0
        self._num_prefix_waits = 0

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises SchedulerError if it could never run."""
        if request.request_id in self.requests:
            raise SchedulerError(f"request {request.request_id} already exists")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise SchedulerError(
                f"request {request.request_id}: the prompt has {request.num_prompt_tokens} "
                f"tokens; the context limit is {max_len}, output included"
            )
        num_tokens = min(request.num_prompt_tokens + request.params.max_tokens, max_len)
        num_blocks = self.kv.pools[FULL_GROUP].num_blocks
        if cdiv(num_tokens, BLOCK_SIZE) > num_blocks:
            raise SchedulerError(
                f"request {request.request_id}: {num_tokens} tokens (prompt + max_tokens) need "
                f"more KV cache than there is ({num_blocks * BLOCK_SIZE} tokens)"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if it is unknown or finished. Call
        it between steps (an output already scheduled for it is then ignored)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._finished_ids.append(request_id)
        logger.debug("request %s aborted", request_id)
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------------

    def schedule(self, *, ahead: bool = False) -> SchedulerOutput:
        """The next step. ``ahead``: while the last scheduled step is still in flight (async
        scheduling; module docstring); an empty output is then not in flight."""
        self._check_in_flight(ahead)
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        for request in self._decodes_then_prefills():
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier this step
                continue
            if self._ends_with_placeholder(request):  # finishes when its token is read
                continue
            num_new = min(request.num_tokens_to_compute, budget, self.config.chunk_tokens)
            old_lengths = [len(table) for table in request.block_ids]
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled[request.request_id] = self._scheduled(request, num_new, old_lengths)
                budget -= num_new
        if not preempted:
            budget = self._admit(budget, scheduled)
        if not scheduled and not preempted and self.requests and not self._in_flight:
            # Nothing runs although blocks are all free: add_request let in the impossible.
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, none admitted")
        if ahead and not scheduled:  # nothing to run beside the step in flight
            return SchedulerOutput(step=self._step, scheduled=(), num_decodes=0,
                                   preempted_request_ids=tuple(preempted),
                                   finished_request_ids=())  # fmt: skip
        entries = sorted(scheduled.values(), key=lambda s: not s.is_decode)
        output = SchedulerOutput(
            step=self._step,
            scheduled=tuple(entries),
            num_decodes=sum(1 for s in entries if s.is_decode),
            preempted_request_ids=tuple(preempted),
            finished_request_ids=tuple(self._finished_ids),
        )
        self._finished_ids = []
        self._step += 1
        if not output.is_empty:
            self._in_flight.append(output)
        return output

    def _decodes_then_prefills(self) -> list[Request]:
        """The running requests with tokens to compute, decodes first (in one pass: this runs
        over every running request at every step)."""
        decodes, prefills = [], []
        for request in self.running:
            to_compute = request.num_tokens_to_compute
            if to_compute == 1:
                decodes.append(request)
            elif to_compute > 1:
                prefills.append(request)
        return decodes + prefills

    def _check_in_flight(self, ahead: bool) -> None:
        if not ahead:
            if self._in_flight:
                raise RuntimeError("schedule() called before update_from_output() of the last step")
            return
        if len(self._in_flight) != 1:
            raise RuntimeError("schedule(ahead=True) needs exactly one step in flight")
        self._count_ahead(self._in_flight[0])

    def _count_ahead(self, output: SchedulerOutput) -> None:
        """Count the in-flight ``output``'s tokens as computed, with a placeholder for each
        token it samples."""
        for entry in output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None:  # aborted since
                continue
            self._count_computed(request, entry)
            if entry.is_sampled:
                request.append_output_token(PLACEHOLDER_TOKEN)
        self._counted = output

    def _count_computed(self, request: Request, entry: ScheduledRequest) -> None:
        request.num_computed_tokens += entry.num_new_tokens
        self.kv.register_computed_blocks(request)
        self.kv.free_outside_window(request)

    def _ends_with_placeholder(self, request: Request) -> bool:
        """Whether the pending token is the request's last whatever it is."""
        return request.has_placeholder and (
            request.num_output_tokens >= request.params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        )

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        deferred: list[Request] = []
        pending: set[bytes] | None = None  # built on first need (see _waits_for_pending)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.find_cached_prefix(request)
            if self.kv.enable_prefix_caching:
                if pending is None:  # the running prefills' blocks (decodes have none)
                    pending = set()
                    for running in self.running:
                        if running.num_computed_tokens < running.num_prompt_tokens:
                            pending.update(_pending_prompt_blocks(running))
                if _waits_for_pending(request, prefix, pending):
                    deferred.append(self.waiting.popleft())
                    continue
            num_new = min(request.num_tokens - prefix.num_tokens, budget, self.config.chunk_tokens)
            if not self.kv.allocate(request, num_new, prefix):
                break
            self.waiting.popleft()
            self._start(request, prefix)
            scheduled[request.request_id] = self._scheduled(request, num_new, None)
            budget -= num_new
            if pending is not None:
                pending.update(_pending_prompt_blocks(request))
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order
        self._num_prefix_waits += len(deferred)
        return budget

    def _start(self, request: Request, prefix: CachedPrefix) -> None:
        request.num_computed_tokens = prefix.num_tokens
        if request.num_preemptions == 0:  # usage reports the first admission's hit
            request.num_cached_tokens = min(prefix.num_tokens, request.num_prompt_tokens)
        self._num_prefix_queried_tokens += request.num_tokens
        self._num_prefix_hit_tokens += prefix.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("request %s preempted (%d tokens)", request.request_id, request.num_tokens)

    def _scheduled(
        self, request: Request, num_new: int, old_lengths: list[int] | None
    ) -> ScheduledRequest:
        """``old_lengths``: the block tables' lengths before this step (None: just admitted)."""
        start = request.num_computed_tokens
        is_new = old_lengths is None
        if old_lengths is None:
            old_lengths = [0] * len(request.block_ids)
        tables = request.frozen_block_ids()
        lengths = [len(table) for table in tables]
        if lengths == old_lengths:
            new_block_ids = ((),) * len(tables)  # a decode inside its last block
        else:
            new_block_ids = tuple(
                table[old:] for table, old in zip(tables, old_lengths, strict=True)
            )
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start : start + num_new]),
            num_computed_tokens=start,
            block_ids=tables,
            new_block_ids=new_block_ids,
            is_new=is_new,
            is_sampled=start + num_new == request.num_tokens,
            num_cached_tokens=start if is_new else 0,
        )

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[RequestOutput]:
        """Record a computed step, the oldest in flight. ``sampled_token_ids`` holds one token
        for every scheduled request with ``is_sampled``. Returns what each request got,
        finishes included. (An empty output, never in flight, gives nothing.)"""
        if output.is_empty:
            return []
        if not self._in_flight or output is not self._in_flight[0]:
            raise RuntimeError("update_from_output() expects the output of the last schedule()")
        self._in_flight.popleft()
        counted = output is self._counted
        if counted:
            self._counted = None
        results = []
        finished: set[str] = set()
        for entry in output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None:  # aborted after schedule(): its blocks are already free
                continue
            if not counted:
                self._count_computed(request, entry)
            if not entry.is_sampled:
                continue
            token = sampled_token_ids[entry.request_id]
            if counted:
                request.resolve_placeholder(token)
            else:
                request.append_output_token(token)
            status = self._finish_status(request, token)
            if status is not None:
                request.status = status
                self.kv.free(request)  # preempted since: holds nothing
                del self.requests[request.request_id]
                finished.add(request.request_id)
                self._finished_ids.append(request.request_id)
            results.append(
                RequestOutput(
                    request.request_id, (token,), request.status.finish_reason,
                    request.num_cached_tokens,
                )
            )  # fmt: skip
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
            if any(r.request_id in finished for r in self.waiting):  # preempted ahead
                self.waiting = deque(r for r in self.waiting if r.request_id not in finished)
        return results

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        if token in request.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH  # the context is full
        return None

    # -- observation -----------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        sliding = self.kv.pools[SLIDING_GROUP].usage if self.kv.has_sliding_group else 0.0
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            sliding_kv_usage=sliding,
            num_preemptions=self._num_preemptions,
            num_prefix_queried_tokens=self._num_prefix_queried_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
            num_prefix_waits=self._num_prefix_waits,
        )


def _pending_prompt_blocks(request: Request) -> list[bytes]:
    """The hashes of the full prompt blocks a running request has yet to register: blocks
    that its prefill computes in this step or a later one."""
    num_prompt_blocks = min(request.num_prompt_tokens // BLOCK_SIZE, len(request.block_hashes))
    return request.block_hashes[request.num_registered_blocks : num_prompt_blocks]


def _waits_for_pending(request: Request, prefix: CachedPrefix, pending: set[bytes]) -> bool:
    """Whether a waiting request should wait for a running prefill: when the blocks right
    after its cached prefix are ones that prefill is computing (the same tokens after the same
    prefix) and make up at least half of what it would compute itself. It then waits a step
    or more and finds them in the cache instead of computing them too: a chat request's n
    choices, agents sent out together with one long context. A short shared head (the system
    message every prompt begins with) is not worth a step's delay."""
    start = prefix.num_tokens // BLOCK_SIZE
    stop = min((request.num_tokens - 1) // BLOCK_SIZE, len(request.block_hashes))  # cacheable
    shared = start
    while shared < stop and request.block_hashes[shared] in pending:
        shared += 1
    num_shared = (shared - start) * BLOCK_SIZE
    return num_shared > 0 and 2 * num_shared >= request.num_tokens - prefix.num_tokens
