"""Intervals for success rates, shared by every report (the evaluate stage, baselines, benches)."""

from __future__ import annotations

import math


def wilson_interval(k: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a success rate (sane at 0/n and n/n, unlike the normal one).
    `k` may be fractional: a mean rate times the number of independent units it averages."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
