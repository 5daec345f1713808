"""`ratchet evolve`'s output: one row per generation, then where to look."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ratchet.cli.common import console
from ratchet.config import Settings


def versus(row: Any) -> str:
    """Random's level on the same tasks, and whether the policy beats it (one-sided sign test)."""
    if row.random_success is None:
        return "—"
    mark = "" if row.vs_random_p is None else (" ▲" if row.vs_random_p <= 0.05 else "")
    return f"{row.random_success:.0%}{mark}"


def print_evolution(settings: Settings, journal: Any) -> None:
    """The journal's generations as a table: held-out success, what landed, what it cost."""
    table = Table(
        "gen",
        "test [95% CI]",
        "random",
        "gold",
        "explore",
        "gated",
        "promoted",
        "rejected",
        "adapter",
        "tokens",
        "min",
        title=f"evolution {settings.evolution} · {settings.suite}",
    )
    for row in journal.rows():
        test = "—"
        if row.test_n:
            lo, hi = row.test_ci95
            test = f"{row.test_successes}/{row.test_n} {row.test_success:.0%} [{lo:.0%}–{hi:.0%}]"
        table.add_row(
            str(row.generation),
            test,
            versus(row),
            "—" if row.gold_success is None else f"{row.gold_success:.0%}",
            "—" if row.explore_success is None else f"{row.explore_success:.0%}",
            str(row.candidates),
            ", ".join(row.promoted) or "—",
            str(row.rejected),
            row.adapter or "—",
            f"{row.tokens / 1000:.0f}k",
            f"{row.wall_seconds / 60:.1f}",
        )
    console.print(table)
    console.print(
        "random: a uniformly random valid action each step, same tasks and step budget (▲: the policy "
        "beats it, sign test p ≤ 0.05); gold: the suite's reference solutions",
        soft_wrap=True,
    )
    console.print(f"journal: {journal.path}", soft_wrap=True)
    console.print(f"MLflow: mlflow ui --backend-store-uri {settings.mlflow_uri}", soft_wrap=True)
    console.print("dashboard: ratchet dashboard", soft_wrap=True)
