"""Builds the GPU engine from loaded weights: measure the memory a step needs, size and
allocate the KV cache under the cap, capture the decode graphs, and wire scheduler, runner and
engine core together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from gptoss_serve.config import EngineConfig, SchedulerConfig
from gptoss_serve.engine import seats
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.client import EngineInfo
from gptoss_serve.engine.compile_watch import watch_late_compiles
from gptoss_serve.engine.cuda_graphs import graph_batch_sizes
from gptoss_serve.engine.engine import EngineCore
from gptoss_serve.engine.forward import forward
from gptoss_serve.engine.input_batch import InputBatch
from gptoss_serve.engine.kv_cache import allocate_kv_cache
from gptoss_serve.engine.kv_manager import KvCacheManager, cdiv
from gptoss_serve.engine.kv_sizing import (
    GIB,
    KvCachePlan,
    KvCacheSpec,
    kv_cache_bytes,
    plan_kv_cache,
    seqs_that_fit,
    sliding_blocks,
)
from gptoss_serve.engine.model_runner import ModelRunner, SamplingBatch
from gptoss_serve.engine.ops import REFERENCE_OPS, Ops, kernel_ops
from gptoss_serve.engine.scheduler import Scheduler
from gptoss_serve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from gptoss_serve.engine.weights import ModelWeights
from gptoss_serve.kernels.kv_dtype import cache_dtype
from gptoss_serve.kernels.sampling import LOGPROB_BUCKETS, token_logprobs

logger = logging.getLogger(__name__)

# Kept free beyond the measured peak of one step: CUDA graphs' pool, the sampler's buffers,
# allocator fragmentation, and with an FP8 cache the bf16 copies of a long context's blocks
# that prefill takes beyond the profiled step's (at most kv_dtype.UPCAST_MAX_BYTES, 256 MiB).
RESERVE_BYTES = GIB


def build_engine(
    weights: ModelWeights, config: EngineConfig, *, forward_bytes: int | None = None
) -> tuple[Callable[[], EngineCore], ModelRunner, KvCachePlan]:
    """Returns a factory of engine cores (a fresh scheduler over the same runner and cache:
    what a failed step restarts with), the runner, and the KV cache plan. With
    ``config.fit_max_num_seqs`` the seats are first settled on what this GPU holds
    (``settled_config``); ``runner.batch.max_num_seqs`` gives the count. ``forward_bytes``:
    ``step_forward_bytes`` of this config, if the caller measured it already."""
    if forward_bytes is None:
        forward_bytes = step_forward_bytes(weights, config)
    config = settled_config(weights, config, forward_bytes=forward_bytes)
    model = weights.config
    scheduler_config, ops, spec = _engine_parts(weights, config)
    kv_dtype = cache_dtype(config.kv_cache_dtype, weights.dtype)
    plan = _plan(weights, config, scheduler_config, spec, forward_bytes)
    kv = allocate_kv_cache(
        model,
        num_full_blocks=plan.num_full_blocks,
        num_sliding_blocks=plan.num_sliding_blocks,
        device=weights.device,
        dtype=kv_dtype,
    )
    runner = ModelRunner(
        weights, kv, scheduler_config, ops=ops, use_cuda_graphs=config.use_cuda_graphs,
        piecewise_max_tokens=config.piecewise_max_tokens,
    )  # fmt: skip
    runner.capture_graphs()
    if weights.device.type == "cuda" and not config.reference_ops:
        warm_up(runner, scheduler_config, plan)
        watch_late_compiles()

    def make_core() -> EngineCore:
        manager = KvCacheManager(
            plan.num_full_blocks,
            plan.num_sliding_blocks,
            sliding_window=model.sliding_window if spec.num_sliding_layers else None,
            enable_prefix_caching=scheduler_config.enable_prefix_caching,
        )
        return EngineCore(
            Scheduler(scheduler_config, manager), runner, async_scheduling=config.async_scheduling
        )

    return make_core, runner, plan


def settled_config(
    weights: ModelWeights, config: EngineConfig, *, forward_bytes: int | None = None
) -> EngineConfig:
    """``config`` with its seat count settled (engine/seats.py): measured on the GPU, or the
    fixed MIN_SEATS where the cache is not sized from the device. The step's forward pass is
    profiled once (``step_forward_bytes``, unless given) for every seat count tried."""
    if not _sized_on_device(weights, config):
        return seats.unmeasured_seats(config)
    measured = [] if forward_bytes is None else [forward_bytes]

    def fits_at(tried: EngineConfig) -> int:
        if not measured:  # the first count tried: profile the forward pass now
            measured.append(_forward_bytes(weights, tried))
        return seqs_that_fit_gpu(weights, tried, tokens_per_seq=seats.SEAT_TOKENS,
                                 forward_bytes=measured[0])  # fmt: skip

    return seats.fit_seats(config, fits_at)


def _sized_on_device(weights: ModelWeights, config: EngineConfig) -> bool:
    """The KV cache is sized from the device's free memory (not given in tokens)."""
    return weights.device.type == "cuda" and config.kv_cache_tokens is None


def build_async_engine(weights: ModelWeights, model_name: str, config: EngineConfig) -> AsyncEngine:
    make_core, runner, plan = build_engine(weights, config)
    info = EngineInfo(
        model_name=model_name,
        # A request's prompt + output must fit the KV cache too: the server then answers a
        # longer prompt with a 400 (context_length_exceeded), not a failed response.
        max_context_tokens=min(runner.batch.max_model_len, plan.max_num_tokens),
        vocab_size=weights.config.vocab_size,
        created_at=int(time.time()),
    )
    return AsyncEngine(make_core, info)


def _engine_parts(
    weights: ModelWeights, config: EngineConfig
) -> tuple[SchedulerConfig, Ops, KvCacheSpec]:
    """The scheduler settings (max_model_len capped by the model's), the ops and the KV cache's
    shape that an engine of ``config`` over ``weights`` runs with."""
    scheduler = replace(
        config.scheduler,
        max_model_len=min(config.scheduler.max_model_len, weights.config.max_position_embeddings),
    )
    ops = REFERENCE_OPS if config.reference_ops else kernel_ops(pdl=config.programmatic_launch)
    kv_dtype = cache_dtype(config.kv_cache_dtype, weights.dtype)
    spec = KvCacheSpec.from_model_config(weights.config, dtype_bytes=kv_dtype.itemsize)
    return scheduler, ops, spec


def _plan(
    weights: ModelWeights,
    config: EngineConfig,
    scheduler: SchedulerConfig,
    spec: KvCacheSpec,
    forward_bytes: int | None,
) -> KvCachePlan:
    if not _sized_on_device(weights, config):
        tokens = config.kv_cache_tokens or scheduler.max_model_len
        num_sliding = sliding_blocks(spec, scheduler.max_num_seqs,
                                     scheduler.max_num_batched_tokens,
                                     config.num_spare_sliding_blocks)  # fmt: skip
        return KvCachePlan(cdiv(tokens, BLOCK_SIZE), num_sliding, spec)
    if forward_bytes is None:
        forward_bytes = _forward_bytes(weights, config)
    return plan_kv_cache(
        spec,
        _kv_cache_bytes(weights, config, scheduler, forward_bytes),
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        num_spare_sliding_blocks=config.num_spare_sliding_blocks,
    )


def _kv_cache_bytes(
    weights: ModelWeights, config: EngineConfig, scheduler: SchedulerConfig, forward_bytes: int
) -> int:
    """Device bytes the KV cache may take under the config's cap, after one step's peak: the
    forward pass's (measured once) and what the config's seats add."""
    peak = forward_bytes + seat_bytes(weights, scheduler)
    logger.info("one step of %d tokens at %d seats needs %.2f GiB beyond the weights",
                scheduler.max_num_batched_tokens, scheduler.max_num_seqs, peak / GIB)  # fmt: skip
    free, total = torch.cuda.mem_get_info(weights.device)
    max_bytes = None if config.max_gpu_memory_gb is None else int(config.max_gpu_memory_gb * 1e9)
    return kv_cache_bytes(
        total_bytes=total,
        free_bytes=free,
        used_bytes=torch.cuda.memory_reserved(weights.device),
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_gpu_memory_bytes=max_bytes,
        reserve_bytes=peak + RESERVE_BYTES,
    )


def seqs_that_fit_gpu(
    weights: ModelWeights, config: EngineConfig, *, tokens_per_seq: int, forward_bytes: int
) -> int:
    """How many sequences of ``tokens_per_seq`` tokens of context each the KV cache could hold
    at once on this GPU under ``config`` (full-attention blocks and sliding windows;
    ``kv_sizing.seqs_that_fit``), as ``build_engine`` sizes the cache: a step's peak at the
    config's ``max_num_seqs``, so the answer errs low for fewer."""
    scheduler, _, spec = _engine_parts(weights, config)
    return seqs_that_fit(
        spec,
        _kv_cache_bytes(weights, config, scheduler, forward_bytes),
        tokens_per_seq=tokens_per_seq,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        num_spare_sliding_blocks=config.num_spare_sliding_blocks,
    )


def step_forward_bytes(weights: ModelWeights, config: EngineConfig) -> int | None:
    """Peak bytes the forward pass of one step of the full token budget allocates beyond what
    is held now and its input buffers (None where the KV cache is not sized from the device):
    one dummy prefill over a scratch cache (of the config's KV dtype) just large enough, then
    everything is freed. It does not depend on the seats, so settling them takes one of these,
    and the cache's sizing reuses it (bench/RESULTS.md e29)."""
    if not _sized_on_device(weights, config):
        return None
    return _forward_bytes(weights, config)


def _forward_bytes(weights: ModelWeights, config: EngineConfig) -> int:
    scheduler, ops, _ = _engine_parts(weights, config)
    kv_dtype = cache_dtype(config.kv_cache_dtype, weights.dtype)
    device = weights.device
    num_tokens = scheduler.max_num_batched_tokens
    num_blocks = cdiv(num_tokens, BLOCK_SIZE)
    scratch = allocate_kv_cache(
        weights.config,
        num_full_blocks=num_blocks,
        num_sliding_blocks=num_blocks,
        device=device,
        dtype=kv_dtype,
    )
    batch = _input_batch(weights, scheduler)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    inputs = batch.prepare(_dummy_step([], num_tokens))
    forward(
        weights,
        scratch,
        ops,
        inputs.input_ids,
        inputs.metadata,
        logits_indices=inputs.logits_indices,
        valid_rows=inputs.valid_rows,
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, batch, inputs
    torch.cuda.empty_cache()
    logger.info("the forward pass of %d tokens needs %.2f GiB", num_tokens, peak / GIB)
    return peak


def seat_bytes(weights: ModelWeights, scheduler: SchedulerConfig) -> int:
    """Device bytes a step needs for ``scheduler.max_num_seqs`` seats: the runner's input
    buffers (InputBatch: its block tables grow with the seats), allocated here and measured,
    plus a full decode batch's logits: float32 rows in the graphs' shared buffer
    (cuda_graphs.py, allocated after the cache) and a step's own working copies beside them
    (an eager step's float32 logits from bf16; a grammar mask's int32 bits, bools and masked
    copy: ~9 bytes a logit). 16 bytes a logit: 3.3 GB at 1024 seats of a 201k vocabulary."""
    device = weights.device
    before = torch.cuda.memory_allocated(device)
    batch = _input_batch(weights, scheduler)
    buffers = torch.cuda.memory_allocated(device) - before
    del batch
    torch.cuda.empty_cache()
    return buffers + scheduler.max_num_seqs * weights.config.vocab_size * 4 * 4


def _input_batch(weights: ModelWeights, scheduler: SchedulerConfig) -> InputBatch:
    return InputBatch(
        max_num_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        max_model_len=scheduler.max_model_len,
        num_groups=2,
        device=weights.device,
    )


# Tokens of the prefill chunk beside the warm-up's decode batches.
WARM_UP_CHUNK = 16


def warm_up(runner: ModelRunner, scheduler: SchedulerConfig, plan: KvCachePlan) -> None:
    """Run the eager step shapes once before serving, so that Triton compiles its variants
    (MoE tile buckets by token count, split counts of the decode attention, prefill over a
    cache) now and not inside the first users' requests. Writes only free KV blocks."""
    started = time.perf_counter()
    num_blocks = min(plan.num_full_blocks, plan.num_sliding_blocks or plan.num_full_blocks)
    for num_tokens in warm_up_prefill_sizes(scheduler.max_num_batched_tokens):
        if cdiv(num_tokens, BLOCK_SIZE) <= num_blocks:
            runner.forward(_dummy_step([], num_tokens))
    for batch, context in warm_up_mixed_shapes(scheduler):
        if cdiv(context, BLOCK_SIZE) <= num_blocks:
            runner.forward(_dummy_step([context] * batch, WARM_UP_CHUNK))
    # The sampler at every decode batch size, with and without the nucleus search (top_p 1,
    # the API's default, skips it: another compiled variant).
    vocab = runner.weights.config.vocab_size
    for rows in graph_batch_sizes(scheduler.max_num_seqs):
        logits = torch.zeros(rows, vocab, dtype=torch.float32, device=runner.device)
        for top_p in (0.9, 1.0):
            batch = SamplingBatch([1.0] * rows, [top_p] * rows, [0] * rows, [0] * rows)
            runner.sample(logits, batch, None)
    # Log-probabilities (a request's top_logprobs): a compiled variant per bucket of k.
    logits = torch.zeros(1, vocab, dtype=torch.float32, device=runner.device)
    for k in LOGPROB_BUCKETS:
        token_logprobs(logits, torch.zeros(1, dtype=torch.int64, device=runner.device), k)
    torch.cuda.synchronize(runner.device)
    logger.info("warm-up of the eager step shapes: %.1fs", time.perf_counter() - started)


def warm_up_prefill_sizes(budget: int) -> list[int]:
    """Prefill-only step sizes: every size below 16 (the decode router's token buckets, 1, 2,
    4, 8 and 16 rows, each with a count Triton specialises or not: a prompt whose prefix is
    cached leaves a step of a few tokens), powers of two from 16 and the halfway sizes between
    them (the MoE's tile rows by token count, 128 / 384 / 1024 ..., and its constexprs by
    powers of two of the pairs all meet one), and the whole token budget."""
    powers = [1 << i for i in range(4, budget.bit_length())]
    halfway = [p + p // 2 for p in powers if p + p // 2 <= budget]
    small = range(1, min(16, budget + 1))
    return sorted({*small, *powers, *halfway, budget})


def warm_up_mixed_shapes(scheduler: SchedulerConfig) -> list[tuple[int, int]]:
    """(decode batch, context) of the eager steps that hold decodes beside a prefill chunk:
    their attention is sized by the real context, so every decode-attention tile row (by
    batch) meets every split count from 1 (short contexts) to the most. The batch leaves room
    in the step for the prefill's request (max_num_seqs) and its chunk (the token budget)."""
    most = min(scheduler.max_num_seqs - 1, scheduler.max_num_batched_tokens - WARM_UP_CHUNK)
    if most < 1:
        return []
    batches = sorted({min(b, most) for b in (1, 4, 16, 32, 64)})
    contexts = [c for c in (1 << i for i in range(6, 17)) if c < scheduler.max_model_len]
    return [(batch, context) for context in contexts for batch in batches]


def _dummy_step(decode_lens: list[int], num_prefill_tokens: int) -> SchedulerOutput:
    """Decodes at the given lengths and one prefill, all over blocks 0, 1, 2 ..."""
    longest = max([num_prefill_tokens, *decode_lens])
    table = tuple(range(cdiv(longest, BLOCK_SIZE)))
    entries = [
        ScheduledRequest(
            request_id=f"warm-{index}", token_ids=(0,), num_computed_tokens=length - 1,
            block_ids=(table, table), new_block_ids=((), ()), is_new=False, is_sampled=True,
        )
        for index, length in enumerate(decode_lens)
    ]  # fmt: skip
    entries.append(
        ScheduledRequest(
            request_id="warm-prefill", token_ids=(0,) * num_prefill_tokens,
            num_computed_tokens=0, block_ids=(table, table), new_block_ids=(table, table),
            is_new=True, is_sampled=True,
        )
    )  # fmt: skip
    return SchedulerOutput(step=-1, scheduled=tuple(entries), num_decodes=len(decode_lens),
                           preempted_request_ids=(), finished_request_ids=())  # fmt: skip
