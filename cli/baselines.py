"""One line that puts a success rate beside the random policy's and the gold path's."""

from __future__ import annotations

from typing import Any


def bar_line(b: Any, vs: Any) -> str:
    """'random 53% [36–69%] (5 seeds) · gold 93% · beats random: 12 tasks better, 3 worse, p = 0.018'."""
    parts = []
    if b.random is not None:
        lo, hi = b.random.ci95
        parts.append(f"random valid action {b.random.rate:.0%} [{lo:.0%}–{hi:.0%}] ({b.seeds} seeds/task)")
    else:
        parts.append("random: n/a (the suite lists no valid actions)")
    if b.gold is not None:
        parts.append(f"gold path {b.gold.rate:.0%}")
    if vs is not None:
        verdict = "beats random" if vs.beats() else "does not beat random"
        parts.append(f"{verdict}: better on {vs.better} tasks, worse on {vs.worse}, p = {vs.p_value:.2g}")
    return "same tasks: " + " · ".join(parts)
