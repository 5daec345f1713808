"""What a person sees of a stage's outcome: Rich output for the CLI (`ratchet <stage>`,
`ratchet run`), one function per outcome type, called by that type's `render`
(`ratchet.flows.stage.StageOutcome`). The console is the caller's; nothing here runs a stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from rich.console import Console

    from ratchet.config import Settings


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


def rollouts(console: Console, settings: Settings, results: Sequence[Any], run_id: str | None = None) -> None:
    """Explore and evaluate outcomes as one table, then the baselines and where things are."""
    table = Table(
        "stage",
        "split",
        "tasks",
        "runs",
        "success [95% CI]",
        "steps",
        "tokens",
        "err",
        "wall",
        title=f"evolution {settings.evolution} · {settings.suite}",
    )
    for r in results:
        rep = r.report
        lo, hi = rep.ci95
        table.add_row(
            r.stage,
            rep.split,
            str(len(rep.by_task)),
            str(rep.n),
            f"{rep.success_rate:.0%} [{lo:.0%}–{hi:.0%}]",
            f"{rep.mean_steps:.1f}",
            f"{(rep.prompt_tokens + rep.completion_tokens) / 1000:.0f}k",
            str(rep.errors),
            f"{r.wall_seconds:.0f}s",
        )
    console.print(table)
    for r in results:
        if r.baselines is not None:
            console.print(bar_line(r.baselines, r.vs_random), soft_wrap=True)
    policy = results[0].policy_version if results else "?"
    console.print(
        f"policy {policy} · trajectories in {settings.trajectories_db}"
        + (f" · MLflow run {run_id}" if run_id else ""),
        soft_wrap=True,
    )
    console.print(f"browse: mlflow ui --backend-store-uri {settings.mlflow_uri}", soft_wrap=True)


def diagnose(console: Console, result: Any) -> None:
    modes = ", ".join(f"{m} {n}" for m, n in sorted(result.by_mode.items(), key=lambda kv: -kv[1]))
    big = [c for c in result.clusters if c.size > 1]
    console.print(
        f"diagnosed {result.failures} failures ({result.diagnosed} new, {result.judged} read by the "
        f"judge): {modes or 'none'}; "
        f"{len(result.clusters)} clusters, {len(big)} with 2+ members · see `ratchet failures`",
        soft_wrap=True,
    )
    if result.discarded:  # a judge that writes '...' shows here, not as empty causes
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(result.discarded.items()))
        console.print(f"judge answers discarded: {result.judge_discarded} ({why})", soft_wrap=True)


def distill(console: Console, result: Any) -> None:
    table = Table("candidate", "kind", "family", "filed", "from", title="distilled candidates")
    for c in result.candidates:
        filed = "new" if c.result.action == "added" else f"merged ({c.result.into_status})"
        table.add_row(c.result.name, c.skill.kind, c.skill.family, filed, f"{len(c.skill.provenance)} traj")
    console.print(table)
    for d in result.dropped:
        console.print(f"[dim]dropped {d['job']}: {'; '.join(d['problems'])[:160]}[/]", highlight=False)


def verify(console: Console, result: Any) -> None:
    table = Table(
        "candidate",
        "kind",
        "status",
        "repairs",
        "regressions",
        "tasks",
        "p",
        "reason",
        title=f"verify against champion {result.champion}",
    )
    for v in result.verdicts:
        d = v.decision
        row = [
            v.skill,
            v.kind,
            v.status,
            str(d.repairs),
            str(d.regressions),
            str(d.tasks),
            f"{d.p_value:.3g}",
        ]
        table.add_row(*row, d.reason)
    console.print(table)
    if result.skipped:
        console.print(f"[dim]not tested (no dev tasks in this suite): {', '.join(result.skipped)}[/]")
    if result.waiting:
        console.print(
            f"[dim]waiting for a later generation (verify.max_candidates): {', '.join(result.waiting)}[/]"
        )


def finetune(console: Console, result: Any) -> None:
    console.print(f"[bold]finetune[/]: {result.action} · {escape(result.reason)}")
    c = result.counts
    console.print(
        f"data {result.dataset}: {c.get('examples', 0)} examples from {c.get('trajectories', 0)} "
        f"successes on {c.get('tasks', 0)} tasks ({c.get('successes', 0)} successes seen)"
    )
    if result.export_path:
        console.print(f"exported (OpenAI fine-tuning JSONL): {result.export_path}")
    if result.version is not None:
        console.print(
            f"adapter v{result.version}: {result.status} · `ratchet adapters show {result.version}`"
        )
