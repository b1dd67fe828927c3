"""The summary math of a benchmark: percentiles and distributions, on plain lists of floats."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between the closest ranks,
    as numpy.percentile's default: p50 of [1, 2, 3, 4] is 2.5."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """p50, p90, p99 and the mean of some samples; all None when there are none (a run whose
    requests all failed, or TTFT without streaming)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        return cls(
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            mean=math.fsum(values) / len(values),
            count=len(values),
        )

    def scaled(self, factor: float) -> Distribution:
        """The same distribution in other units (seconds -> milliseconds)."""

        def scale(value: float | None) -> float | None:
            return None if value is None else value * factor

        return Distribution(
            scale(self.p50), scale(self.p90), scale(self.p99), scale(self.mean), self.count
        )

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)
