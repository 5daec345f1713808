"""Cold start: `ratchet evolve` where the policy rarely succeeds, sampled explore against search.

Arms side by side, each its own evolution and data dir on one embedded server, the same
suite, the same train, dev and test tasks and seeds, own rollouts only (no expert
trajectories):

* **sampled**: `-k` sampled rollouts per train task;
* **search**: `--search-k` sampled rollouts, then search from stored states
  (`explore.search = --calls` model calls per train task none solved; agents/search.py).
  With `-k 4 --search-k 2` and mapreader's ~22 calls a rollout, `--calls 44` spends about the
  same model calls per train task as the sampled arm;
* **search-dpo**: the search arm with `finetune.dpo.enabled` (preference pairs at the step
  where a success and a failure of one task part, after SFT on the same adapter).

Per arm and generation: the held-out row beside the random and gold levels (evolve_gain's
table), and explore's own numbers from the trajectory store: rollouts, successes (sampled and
searched), train tasks solved, model calls, and successes per 1,000 model calls.

    .venv/bin/python -m bench cold_start [--family textworld-express:mapreader] [--arms sampled search]
        [--generations 2] [--train 12] [-k 4] [--search-k 2] [--calls 44] [--dev 32] [--test 30]
        [--data DIR] [--report] [--name cold_start]

Writes bench/results/<name>.json (evolve_gain's document with `explore` per arm) and its plot;
`--data DIR` resumes a killed run, `--report` reports one without running anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench._evolve import EvolveOptions, run_settings
from bench._evolve import run as evolve_run
from bench.harness import RESULTS, interval_text, option, rate_ratio_interval, write_result

if TYPE_CHECKING:
    from ratchet.config import Settings

ARMS = ("sampled", "search", "search-dpo")


@dataclass
class Options(EvolveOptions):
    targets: list[str] = option(["sampled", "search"], "the arms", choices=list(ARMS), flags=("--arms",))
    family: str = option("textworld-express:mapreader", "suite:subset")
    generations: int = option(2)
    train: int = option(12, "train tasks")
    k: int = option(4, "sampled arm: explore rollouts per train task", flags=("-k",))
    search_k: int = option(2, "search arms: sampled rollouts per train task before searching")
    calls: int = option(44, "search arms: model calls per train task none solved")
    name: str = option("cold_start", "results file name under bench/results")


def arm_settings(arm: str, data: Path, opts: EvolveOptions) -> Settings:
    from ratchet.config import load_settings

    assert isinstance(opts, Options)
    explore = (
        {"explore.rollouts_per_task": opts.k, "explore.search": 0}
        if arm == "sampled"
        else {"explore.rollouts_per_task": opts.search_k, "explore.search": opts.calls}
    )
    return load_settings(
        {"data_dir": data / arm, "evolution": "cold-start", "suite": opts.family}
        | run_settings(opts, **{"explore.experts": False, "finetune.dpo.enabled": arm == "search-dpo"})
        | explore
    )


def explore_rows(settings: Settings) -> list[dict[str, Any]]:
    """Explore's numbers per generation, from the arm's trajectory store."""
    from ratchet.memory.trajectory_store import open_store

    if not settings.trajectories_db.exists():
        return []
    store = open_store(settings.trajectories_db)
    try:
        played = [
            t
            for t in store.query(evolution=settings.evolution, split="train")
            if t.kind == "agent" and t.status == "finished"
        ]
    finally:
        store.close()
    rows = []
    for generation in sorted({t.generation for t in played}):
        mine = [t for t in played if t.generation == generation]
        sampled = [t for t in mine if t.branch is None]
        searched = [t for t in mine if t.branch is not None]
        calls = sum(s.source == "model" for t in mine for s in t.steps)
        successes = sum(t.success for t in mine)
        rows.append(
            {
                "generation": generation,
                "sampled_rollouts": len(sampled),
                "sampled_successes": sum(t.success for t in sampled),
                "searched_rollouts": len(searched),
                "searched_successes": sum(t.success for t in searched),
                "tasks_solved": len({t.task_id for t in mine if t.success}),
                "model_calls": calls,
                "successes_per_kilo_call": round(1000 * successes / calls, 2) if calls else 0.0,
            }
        )
    return rows


def explore_table(explore: dict[str, list[dict[str, Any]]], train: int) -> str:
    lines = [
        "| arm | gen | sampled: rollouts, successes | searched: rollouts, successes | train tasks solved "
        "| model calls | successes per 1,000 calls |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, rows in explore.items():
        for r in rows:
            lines.append(
                f"| {arm} | {r['generation']} | {r['sampled_rollouts']}, {r['sampled_successes']} "
                f"| {r['searched_rollouts']}, {r['searched_successes']} | {r['tasks_solved']}/{train} "
                f"| {r['model_calls']} | {r['successes_per_kilo_call']} |"
            )
    lines.extend(first_generation_ratio(explore))
    return "\n".join(lines)


def first_generation_ratio(explore: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each search arm's successes per model call against the sampled arm's, with the exact 95%
    interval, in generation 1 only: the one where both arms explore with the same base policy."""
    firsts = {arm: next((r for r in rows if r["generation"] == 1), None) for arm, rows in explore.items()}
    base = firsts.pop("sampled", None)
    if base is None:
        return []
    out = []
    for arm, r in firsts.items():
        if r is None:
            continue
        found = r["sampled_successes"] + r["searched_successes"]
        lo, hi = rate_ratio_interval(found, r["model_calls"], base["sampled_successes"], base["model_calls"])
        told = interval_text(lo, hi)
        out.append(f"generation 1, {arm} / sampled successes per model call: exact 95% interval {told}")
    return out


def run(opts: Options) -> None:
    evolve_run(opts, arm_settings)
    if opts.redraw is not None or opts.data is None:
        return
    explore = {arm: explore_rows(arm_settings(arm, opts.data, opts)) for arm in opts.targets}
    print(explore_table(explore, opts.train))
    path = RESULTS / f"{opts.name}.json"
    doc = json.loads(path.read_text())
    doc.pop("args", None)
    write_result(opts.name, doc | {"explore": explore}, opts)


__all__ = ["Options", "run"]
