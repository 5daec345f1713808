"""Held-out success per generation of `ratchet evolve`: what evolve_gain and skill_gain run.

Per target its own evolution and data dir, one embedded server. For every generation: test
success with a 95% Wilson interval, the random valid-action policy's level on the same test
tasks with a sign test of the generation against it, and what was promoted (skills, tools,
the adapter). `--data DIR` resumes a killed run (the evolve journal skips finished stages);
with `--report` it runs nothing and reports the journals so far; `--redraw FILE.json` redraws
the table and the plot (FILE.png) from a results file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness import RESULTS, embedded_server, fresh_data_dir, option, write_result

if TYPE_CHECKING:
    from ratchet.config import Settings
    from ratchet.flows.journal import Journal


@dataclass
class EvolveOptions:
    targets: list[str] = option(["textworld-express:coin", "reasoning-gym:propositional_logic"])
    generations: int = option(3)
    train: int = option(40, "train tasks per target")
    k: int = option(4, "explore rollouts per train task", flags=("-k",))
    # 32, not 16: from a base rate near 0 the adapter gate needs 5 repairs without a regression
    # (one-sided exact p = 1/32); on 16 dev tasks it refused coin adapters with 2/0 and 3/0.
    dev: int = option(32, "dev tasks the gates may use")
    test: int = option(30)
    concurrency: int = option(8)
    finetune: str = option("auto", "finetune.mode: auto (LoRA here), off (skills, rules, tools only)")
    name: str = option("evolve_gain", "results file name under bench/results")
    overrides: list[str] = option(
        [], "more settings, e.g. explore.temperature=0.3", flags=("--set",), nargs="*", metavar="KEY=VALUE"
    )
    data: Path | None = option(None, "resume a previous run's data")
    report: bool = option(False, "only report --data's journals so far (no runs)")
    redraw: Path | None = option(None, "only redraw table and plot from a results JSON")


def target_settings(target: str, data: Path, opts: EvolveOptions) -> Settings:
    from ratchet.config import load_settings

    return load_settings(
        {"data_dir": data / target.replace(":", "-"), "evolution": "headline", "suite": target}
        | run_settings(opts)
    )


def run_settings(opts: EvolveOptions, **defaults: Any) -> dict[str, Any]:
    """The settings every target of a run shares: its sizes, then `defaults`, then `--set`."""
    return (
        {
            "splits.train": opts.train,
            "splits.dev": opts.dev,
            "splits.test": opts.test,
            "explore.rollouts_per_task": opts.k,
            "concurrency": opts.concurrency,
            "evolve.generations": opts.generations,
            "finetune.mode": opts.finetune,
        }
        | defaults
        | dict(kv.split("=", 1) for kv in opts.overrides)  # pydantic parses the strings ("0.3", "true")
    )


def report_rows(journal: Journal, settings: Settings | None = None) -> list[dict[str, Any]]:
    """One dict per generation from the evolve journal, the single source of every number here,
    with the random policy's level on the same test tasks beside each (from the journal; for a
    journal written before it kept them, played now from `settings`' suite and trajectory store)."""
    gates = {r.generation: r.summary.get("reason", "") for r in journal.records if r.stage == "finetune"}
    rows = journal.rows()
    kinds = skill_kinds(settings) if settings is not None else {}
    missing = settings is not None and any(r.test_n and r.random_success is None for r in rows)
    levels = random_levels(settings, rows) if missing else {}
    return [
        {
            "generation": r.generation,
            "successes": r.test_successes,
            "n": r.test_n,
            "success": r.test_success,
            "ci95": r.test_ci95,
            "random": r.random_success
            if r.random_success is not None
            else levels.get(r.generation, {}).get("random"),
            "gold": r.gold_success
            if r.gold_success is not None
            else levels.get(r.generation, {}).get("gold"),
            "vs_random_p": r.vs_random_p
            if r.vs_random_p is not None
            else levels.get(r.generation, {}).get("p"),
            "explore_success": r.explore_success,
            "explore_searched": r.explore_searched,
            "promoted": [f"{n} ({kinds[n]})" if n in kinds else n for n in r.promoted],
            "rejected": r.rejected,
            "adapter": r.adapter,
            "adapter_gate": gates.get(r.generation, ""),
            "stages": r.stages,
            "minutes": round(r.wall_seconds / 60, 1),
        }
        for r in rows
    ]


def skill_kinds(settings: Settings) -> dict[str, str]:
    """Each filed candidate's kind (procedure, guardrail, tool, rule), for the promoted column."""
    from ratchet.skills.library import SkillLibrary

    if not settings.skills_dir.exists():
        return {}
    return {s.name: s.kind for s in SkillLibrary(settings.skills_dir, settings.index_dir).list()}


def random_levels(settings: Settings, rows: list[Any]) -> dict[int, dict[str, Any]]:
    """Random and gold on the evolution's test tasks, and each generation's sign test against
    random from its stored test trajectories (no model: seconds)."""
    from ratchet.agents.baselines import baselines, versus_random
    from ratchet.flows.rollouts import summarize
    from ratchet.memory.trajectory_store import open_store
    from ratchet.suites import suite_from

    suite = suite_from(settings)
    try:
        tasks = suite.tasks("test", settings.splits.test)
        levels = baselines(suite, tasks, settings.evaluate.baseline_seeds, settings.max_steps)
    finally:
        suite.close()
    if levels.random is None:
        return {}
    store = open_store(settings.trajectories_db)
    out = {}
    for r in rows:
        trajs = store.query(evolution=settings.evolution, generation=r.generation, split="test")
        champion = summarize(trajs, "test").by_task  # per-task success, as the evaluate stage counts it
        p = versus_random(champion, levels.random.by_task).p_value if champion else None
        out[r.generation] = {"random": levels.random.rate, "gold": levels.gold and levels.gold.rate, "p": p}
    store.close()
    return out


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The README's markdown table: one line per target and generation."""
    from ratchet.cli.evolve import explored

    lines = [
        "| target | gen | test success | 95% CI | random (same tasks) | vs random | explore (train) "
        "| promoted | candidates rejected | adapter | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target, rows in results.items():
        for r in rows:
            test = "—" if r["n"] is None else f"{r['successes']}/{r['n']} = {r['success']:.0%}"
            ci = "—" if r["ci95"] is None else f"{r['ci95'][0]:.0%}–{r['ci95'][1]:.0%}"
            explore = explored(r["explore_success"], r.get("explore_searched"))
            adapter = r["adapter"] + (f" ({r['adapter_gate']})" if r["adapter_gate"] else "")
            promoted = ", ".join(r["promoted"]) or "—"
            rnd = "n/a" if r.get("random") is None else f"{r['random']:.0%}"
            vs = "—" if r.get("vs_random_p") is None else f"p = {r['vs_random_p']:.2g}"
            lines.append(
                f"| {target} | {r['generation']} | {test} | {ci} | {rnd} | {vs} | {explore} | {promoted} "
                f"| {r['rejected']} | {adapter or '—'} | {r['minutes']} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from ratchet.flows.tracking import success_figure

    evaluated = {t: [r for r in rows if r["n"]] for t, rows in results.items()}
    series = {
        t: [(r["generation"], r["success"], *r["ci95"]) for r in rows]
        for t, rows in evaluated.items()
        if rows
    }
    fig = success_figure(series, "ratchet evolve: held-out success per generation")
    ax = fig.axes[0]
    for container, target in zip(ax.containers, series, strict=False):  # the bar, in each line's colour
        level = next((r["random"] for r in reversed(evaluated[target]) if r.get("random") is not None), None)
        if level is not None:
            color = container.lines[0].get_color()
            ax.axhline(level, color=color, linestyle="--", alpha=0.7, label=f"{target}: random valid action")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def run(
    opts: EvolveOptions, settings_of: Callable[[str, Path, EvolveOptions], Settings] | None = None
) -> int | None:
    """Run (or report) `ratchet evolve` on each target; `settings_of(target, data, opts)`
    gives a target's settings (default `target_settings`: the target is a suite spec)."""
    settings_of = settings_of or target_settings
    if opts.redraw is not None:
        doc = json.loads(opts.redraw.read_text())
        print(table(doc["results"]))
        plot(doc["results"], opts.redraw.with_suffix(".png"))
        return None
    if opts.report:
        if opts.data is None:
            raise SystemExit("--report needs --data DIR")
        from ratchet.flows.journal import Journal

        results = {}
        for t in opts.targets:
            settings = settings_of(t, opts.data, opts)
            results[t] = report_rows(Journal.load(settings), settings)
        write_results(opts, results, wall_seconds=None)
        return None

    if opts.data is None:
        opts.data = fresh_data_dir(f"ratchet-{opts.name.replace('_', '-')}-")
    data = opts.data
    print(f"data: {data}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    dtype = settings_of(opts.targets[0], data, opts).model.dtype  # the server plays what settings say
    with embedded_server(data / "logs", dtype=dtype) as url:
        from ratchet.flows.evolve import check_settings, evolve_flow

        for target in opts.targets:
            settings = settings_of(target, data, opts)
            check_settings(settings)
            results[target] = report_rows(evolve_flow(settings=settings, base_url=url), settings)
    write_results(opts, results, wall_seconds=time.perf_counter() - started)
    return None


def write_results(
    opts: EvolveOptions, results: dict[str, list[dict[str, Any]]], wall_seconds: float | None
) -> None:
    """The table on stdout; the JSON and the plot under bench/results (also for a run still going)."""
    print(table(results))
    complete = all(
        any(r["generation"] == opts.generations and r["n"] for r in rows) for rows in results.values()
    )
    doc = {"complete": complete, "results": results, "wall_seconds": wall_seconds}
    write_result(opts.name, doc, opts)
    plot(results, RESULTS / f"{opts.name}.png")
