"""Does search from stored states find successes that sampling, given the same model calls, does not?

Two arms of the real `explore` stage (the shipped SmolLM2-135M, the embedded server, no
expert trajectories), on the same `--train` train tasks and the same first `--rollouts`
sampled rollouts per task (same slot ids, so the same seeds):

* **search**: `--rollouts` sampled, then `explore.search = --calls` model calls per train
  task none of them solved (`agents/search.py`);
* **sampled**: more sampled rollouts per task, as many as it takes to spend at least the
  model calls the search arm spent in all (the plain way to spend the same budget), or
  `--sampled` per task, more than that, where sampling succeeds too rarely to be counted
  at the same budget.

Per arm: train tasks with at least one success (what rules, exemplars and fine-tuning can
learn from: every learning signal the loop has comes from successes), successes, model
calls, successes per 1,000 model calls (the arm's, and for search its searched rollouts'
alone) and their ratio, minutes; and for the search arm, the searched rollouts and where
they branched.
Mapreader is the default: the shipped model solves about 1 in 100 of its rollouts.

    .venv/bin/python -m bench search_gain [--family textworld-express:mapreader] [--train 8]
        [--rollouts 2] [--calls 40] [--sampled N] [--sampled-from FILE] [--out bench/results/search_gain.json]
    .venv/bin/python -m bench search_gain --report bench/results/search_gain.json
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    RESULTS,
    bench_settings,
    embedded_server,
    fresh_data_dir,
    interval_text,
    option,
    rate_ratio_interval,
    write_result,
)


@dataclass
class Options:
    family: str = option("textworld-express:mapreader", "suite:subset explored")
    train: int = option(8, "train tasks")
    rollouts: int = option(2, "sampled rollouts per task in both arms before the search arm searches")
    calls: int = option(40, "search arm: model calls per unsolved train task")
    sampled: int = option(0, "sampled arm: rollouts per task (0: as many as spend the search arm's calls)")
    sampled_from: Path | None = option(
        None, "play the search arm only; the sampled arm is this earlier result file's (same tasks and seeds)"
    )
    concurrency: int = option(8)
    dtype: str = option("auto", "the server's number format", choices=["auto", "bfloat16", "float32"])
    out: Path = option(RESULTS / "search_gain.json")
    report: Path | None = option(None, "play nothing: this earlier result file's table and interval again")


def explore_arm(
    family: str, args: Options, url: str, data: Path, rollouts: int, calls: int
) -> dict[str, Any]:
    from prefect import flow

    from ratchet.flows.explore import explore_stage
    from ratchet.flows.runtime import open_runtime

    settings = bench_settings(
        data,
        {
            "suite": family,
            "splits.train": args.train,
            "explore.rollouts_per_task": rollouts,
            "explore.search": calls,
            "explore.experts": False,
            "concurrency": args.concurrency,
        },
    )

    @flow(name="search-gain", validate_parameters=False)
    def one_arm() -> dict[str, Any]:
        with open_runtime(settings, url) as rt:
            started = time.perf_counter()
            explore_stage(rt, 1, rt.live_policy())
            minutes = (time.perf_counter() - started) / 60
            trajs = [
                t for t in rt.store.query(evolution=settings.evolution, generation=1) if t.kind == "agent"
            ]
        sampled = [t for t in trajs if t.branch is None]
        searched = [t for t in trajs if t.branch is not None]
        model_calls = sum(s.source == "model" for t in trajs for s in t.steps)
        return {
            "rollouts_per_task": rollouts,
            "search_calls": calls,
            "tasks": args.train,
            "tasks_solved": len({t.task_id for t in trajs if t.success}),
            "tasks_solved_by_sampling": len({t.task_id for t in sampled if t.success}),
            "sampled_rollouts": len(sampled),
            "sampled_successes": sum(t.success for t in sampled),
            "searched_rollouts": len(searched),
            "searched_successes": sum(t.success for t in searched),
            "searched_errors": sum(t.status == "error" for t in searched),
            "branch_steps": sorted(t.branch.step for t in searched if t.branch is not None),
            "model_calls": model_calls,
            **progress_counts(trajs),
            "searched_calls": sum(s.source == "model" for t in searched for s in t.steps),
            "sampled_calls_per_rollout": sum(s.source == "model" for t in sampled for s in t.steps)
            / max(1, len(sampled)),
            "minutes": round(minutes, 2),
        }

    return one_arm()


def progress_counts(trajs: list[Any]) -> dict[str, Any]:
    """How far the rollouts got where none finished: rollouts whose reward so far rose above 0
    at some step (the suite's progress signal, where it gives one), and per task the most."""
    best: dict[str, float] = {}
    with_progress = 0
    for t in trajs:
        earned = peak = 0.0
        for step in t.steps:
            earned += step.reward
            peak = max(peak, earned)
        with_progress += peak > 0
        best[t.task_id] = max(best.get(t.task_id, 0.0), peak)
    return {"rollouts_with_progress": with_progress, "best_progress_per_task": best}


def per_kilo(successes: int, calls: int) -> float:
    return 1000 * successes / calls if calls else 0.0


def run(args: Options) -> None:
    if args.report is not None:
        doc = json.loads(args.report.read_text())
        was = doc["args"]
        print(
            "\n".join(
                summarize(doc["search"], doc["sampled"], was["train"], was["rollouts"], was["calls"])[1]
            )
        )
        return
    data = fresh_data_dir("ratchet-search-gain-")
    started = time.perf_counter()
    with embedded_server(data / "logs", dtype=args.dtype) as url:
        search = explore_arm(args.family, args, url, data / "search", args.rollouts, args.calls)
        print(f"search arm: {search}", flush=True)
        extra_calls = max(
            0, search["model_calls"] - search["sampled_calls_per_rollout"] * search["sampled_rollouts"]
        )
        per_task = search["sampled_calls_per_rollout"] * args.train
        more = math.ceil(extra_calls / per_task) if per_task else 0
        k = max(args.sampled, args.rollouts + more)
        if args.sampled_from is not None:  # sampling does not depend on how search picks its cells
            sampled = json.loads(args.sampled_from.read_text())["sampled"]
            if sampled["tasks"] != args.train:
                raise SystemExit(
                    f"{args.sampled_from} explored {sampled['tasks']} tasks, not --train {args.train}"
                )
        else:
            sampled = explore_arm(args.family, args, url, data / "sampled", k, 0)
        print(f"sampled arm: {sampled}", flush=True)
    summary, lines = summarize(search, sampled, args.train, args.rollouts, args.calls)
    print("\n".join(lines))
    write_result(
        "search_gain",
        {
            "search": search,
            "sampled": sampled,
            **summary,
            "minutes": round((time.perf_counter() - started) / 60, 1),
        },
        args,
        path=args.out,
    )


def summarize(
    search: dict[str, Any], sampled: dict[str, Any], train: int, rollouts: int, calls: int
) -> tuple[dict[str, Any], list[str]]:
    """Successes per 1,000 model calls per arm, their ratio, and the ratio's exact 95% interval
    (search arm against sampled; sampling that found nothing has no rate, but the interval's
    lower end still bounds how much better search is)."""
    found = search["sampled_successes"] + search["searched_successes"]
    rates = {
        "sampled": per_kilo(sampled["sampled_successes"], sampled["model_calls"]),
        "search_arm": per_kilo(found, search["model_calls"]),
        "searched_only": per_kilo(search["searched_successes"], search["searched_calls"]),
    }
    ratio = {
        k: (v / rates["sampled"] if rates["sampled"] else None) for k, v in rates.items() if k != "sampled"
    }
    lo, hi = rate_ratio_interval(
        found, search["model_calls"], sampled["sampled_successes"], sampled["model_calls"]
    )
    lines = [
        "| arm | rollouts | model calls | train tasks solved | successes | minutes |",
        "|---|---|---|---|---|---|",
        f"| sampled ×{sampled['rollouts_per_task']} | {sampled['sampled_rollouts']} | "
        f"{sampled['model_calls']} | {sampled['tasks_solved']}/{train} | "
        f"{sampled['sampled_successes']} | {sampled['minutes']} |",
        f"| sampled ×{rollouts} + search {calls} | {search['sampled_rollouts']} + "
        f"{search['searched_rollouts']} | {search['model_calls']} | {search['tasks_solved']}/{train} "
        f"(sampling alone {search['tasks_solved_by_sampling']}) | {search['sampled_successes']} + "
        f"{search['searched_successes']} | {search['minutes']} |",
    ]
    told = {k: "n/a (sampled found none)" if v is None else f"{v:.1f}x" for k, v in ratio.items()}
    lines.append(
        "successes per 1,000 model calls: sampled {sampled:.2f}, search arm {search_arm:.2f}, "
        "searched rollouts alone {searched_only:.2f}".format(**rates)
        + "; ratio to sampled: "
        + ", ".join(f"{k} {v}" for k, v in told.items())
        + f"; search arm / sampled, exact 95% interval: {interval_text(lo, hi)}"
    )
    summary = {
        "successes_per_kilo_call": rates,
        "ratio_to_sampled": ratio,
        "ratio_ci95": [lo, hi],
    }
    return summary, lines
