"""`ratchet evolve`'s output: one row per generation, then where to look."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from ratchet.cli.common import console
from ratchet.config import Settings


def explored(success: float | None, searched: Sequence[int] | None) -> str:
    """Explore's column: the sampled rollouts' success, and what search found after them
    (`searched`: its rollouts and their successes)."""
    if success is None:
        return "—"
    if not searched:
        return f"{success:.0%}"
    n, k = searched
    return f"{success:.0%} +{k}/{n} searched"


def bar(row: Any) -> str:
    """'53%/100%': random's and gold's levels on the same tasks; ▲ when the policy beats random
    (one-sided sign test, p <= 0.05)."""
    if row.random_success is None and row.gold_success is None:
        return "—"
    rnd = "n/a" if row.random_success is None else f"{row.random_success:.0%}"
    gold = "n/a" if row.gold_success is None else f"{row.gold_success:.0%}"
    return f"{'▲ ' if row.beats_random else ''}{rnd}/{gold}"


def versus_first(row: Any) -> str:
    """'+16 −2 p=0.00066': the tasks this generation solves more and less often than generation 0
    (same test tasks, same seeds) and the one-sided sign test's p; ▲ when p <= 0.05."""
    if row.generation == 0:
        return "(the bar)" if row.test_by_task else "—"
    if row.vs_first_p is None:
        return "—"
    mark = "▲ " if row.beats_first else ""
    return f"{mark}+{row.vs_first_better} −{row.vs_first_worse} p={row.vs_first_p:.2g}"


def print_evolution(settings: Settings, journal: Any) -> None:
    """The journal's generations as a table: held-out success, what landed, what it cost."""
    rows = journal.rows()
    levels = any(bar(r) != "—" for r in rows)  # a suite's random or gold level; a task file has none
    table = Table(
        "gen",
        "test [95% CI]",
        "random/gold" if levels else "vs gen 0",
        "explore",
        "gated",
        "promoted",
        "rejected",
        "adapter",
        "tokens",
        "min",
        title=f"evolution {settings.evolution} · {settings.suite}",
    )
    for row in rows:
        test = "—"
        if row.test_n:
            lo, hi = row.test_ci95
            test = f"{row.test_successes}/{row.test_n} {row.test_success:.0%} [{lo:.0%}–{hi:.0%}]"
        table.add_row(
            str(row.generation),
            test,
            bar(row) if levels else versus_first(row),
            explored(row.explore_success, row.explore_searched),
            str(row.candidates),
            ", ".join(row.promoted) or "—",
            str(row.rejected),
            row.adapter or "—",
            f"{row.tokens / 1000:.0f}k",
            f"{row.wall_seconds / 60:.1f}",
        )
    console.print(table)
    if levels:
        console.print(
            "random/gold: a uniformly random valid action each step and the suite's reference solutions, "
            "on the same test tasks and step budget (▲: the policy beats random, sign test p ≤ 0.05)",
            soft_wrap=True,
        )
    else:  # a task file, a suite without a menu or reference solutions, or baselines off
        console.print(
            "vs gen 0: no random or gold level for these tasks, so each generation is read against "
            "generation 0 on the same test tasks and seeds: tasks solved more often (+) and less often (−), "
            "and the paired sign test's one-sided p (▲: better, p ≤ 0.05)",
            soft_wrap=True,
        )
    console.print(f"journal: {journal.path}", soft_wrap=True)
    console.print(
        f"MLflow: mlflow ui --backend-store-uri {settings.mlflow_uri} (experiment "
        f"ratchet-{settings.evolution}: Agent versions, Prompts, Traces, Sessions, Evaluation runs)",
        soft_wrap=True,
    )
    console.print("dashboard: ratchet dashboard", soft_wrap=True)
