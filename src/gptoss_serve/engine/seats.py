"""How many requests may run at once on this GPU (``--max-num-seqs auto``, the default).

A fixed seat count is wrong on every card but one: 64 seats leave an H200 (which holds ~775
sequences of 2k tokens beside 120b's weights) a tenth full, while 1024 seats on an 80 GB card
reserve their sliding windows and logits (~8 MB a seat of 120b) out of a cache that holds ~84
such sequences. So the seats are the sequences of ``SEAT_TOKENS`` tokens of context the KV
cache holds, between ``MIN_SEATS`` (the fixed default before) and ``MAX_SEATS`` (vLLM's default
on GPUs of 70 GB or more, and the largest CUDA-graph batch). Longer requests still run: the
scheduler admits what the blocks hold and preempts when they run out.

The memory one step needs grows with the seats (a full decode batch's logits and their working
copies: 3.3 GB at 1024 seats of 120b), so what fits is measured at the seat count being tried,
again at the count found, until it settles (``settle_seats``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from gptoss_serve.config import EngineConfig

logger = logging.getLogger(__name__)

SEAT_TOKENS = 2048  # tokens of context a seat is sized for (1k in / 1k out)
MIN_SEATS = 64  # never fewer: the fixed default before, and the bench's largest decode batch
MAX_SEATS = 1024  # vLLM's max_num_seqs on GPUs of 70 GB or more; cuda_graphs' largest size
# Measurements at most (an FP8 cache on an H100: 96 fit at 1024 seats, 174 at 96, 168 at 174, 168
# at 168). Each is the seats' own bytes beside one forward profile (startup.py): ~0.05 s.
ROUNDS = 8


def settle_seats(fits_at: Callable[[int], int], *, requested: int, floor: int) -> int:
    """The seats to run with: ``fits_at(seats)`` (the sequences that fit when the step is
    sized for ``seats``) clamped to [floor, requested], measured again at each new count until
    it no longer moves. A count can swing between two (on an H100, a test's cap: 412 fit
    beside 411 seats, 411 beside 412); then, or once ``ROUNDS`` measurements are spent, the
    answer is the largest count measured that fits beside its own seats (else the smallest
    count any measurement gave), never one whose own measurement refused it."""
    given: dict[int, int] = {}  # seats the step was sized for -> the clamped count that fit
    seats = requested
    for _ in range(ROUNDS):
        given[seats] = min(requested, max(fits_at(seats), floor))
        if given[seats] == seats:
            return seats
        seats = given[seats]
        if seats in given:  # a swing between counts already measured
            break
    held = [count for count, fit in given.items() if fit >= count]
    return max(held) if held else min(given.values())


def with_seats(config: EngineConfig, seats: int) -> EngineConfig:
    """``config`` running ``seats`` requests at most, its seat count settled."""
    return replace(config, scheduler=replace(config.scheduler, max_num_seqs=seats),
                   fit_max_num_seqs=False)  # fmt: skip


def fit_seats(config: EngineConfig, fits_at: Callable[[EngineConfig], int]) -> EngineConfig:
    """``config`` with its seats settled: unchanged unless ``fit_max_num_seqs`` asks, else
    ``scheduler.max_num_seqs`` lowered to the sequences of SEAT_TOKENS that ``fits_at`` (the
    KV cache of an engine built from a config) finds room for, never below MIN_SEATS."""
    if not config.fit_max_num_seqs:
        return config
    requested = config.scheduler.max_num_seqs
    measured: list[tuple[int, int]] = []  # (seats the step was sized for, sequences that fit)

    def measure(seats: int) -> int:
        measured.append((seats, fits_at(with_seats(config, seats))))
        return measured[-1][1]

    seats = settle_seats(measure, requested=requested, floor=min(MIN_SEATS, requested))
    logger.warning("max_num_seqs %d (of %d): sequences of %d tokens that fit, by the seats the "
                   "step was sized for: %s", seats, requested, SEAT_TOKENS,
                   ", ".join(f"{fit} at {sized}" for sized, fit in measured))  # fmt: skip
    return with_seats(config, seats)


def unmeasured_seats(config: EngineConfig) -> EngineConfig:
    """``config`` with its seats settled where nothing can be measured (no CUDA device, or a
    KV cache size given in tokens): MIN_SEATS at most when ``fit_max_num_seqs`` asks."""
    if not config.fit_max_num_seqs:
        return config
    return with_seats(config, min(config.scheduler.max_num_seqs, MIN_SEATS))
