"""The bar: random valid action, the shipped model (greedy) and the gold path, on the same tasks.

For each target: the first `--test` tasks of its held-out test split, played by
* the random policy: a uniformly random valid action each step, `--seeds` episodes per task,
  the suite's step budget (suites that list no valid actions have no random row);
* the shipped SmolLM2-135M-Instruct through the real `evaluate` flow: greedy, no skills, no
  adapter, no exploration, no experts (generation 0 of every evolution);
* the gold path: the suite's reference solution within the same step budget (the ceiling).

and the paired sign test of the model against random, task by task. Every gain benchmark
prints the same random row for its own test tasks; this one shows the bar on its own.

    .venv/bin/python -m bench baseline [--test 30] [--seeds 10] [--no-model [--split dev] [--max-steps 8]]
        [--targets textworld-express:coin textworld-express:mapreader ...] [--out FILE]

Writes bench/results/baseline.json (`--no-model`: baseline_levels.json, random and gold only:
the bar for any other bench's task set, e.g. a gate bench's dev tasks and step budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import bench_settings, embedded_server, fresh_data_dir, option, write_result

TARGETS = [
    "textworld-express:coin",
    "textworld-express:mapreader",
    "textworld-express:sorting",
    "reasoning-gym:propositional_logic",
]


def pct(rate: float | None, ci: Any = None) -> str:
    if rate is None:
        return "n/a"
    return f"{rate:.0%}" + (f" ({ci[0]:.0%}–{ci[1]:.0%})" if ci is not None else "")


def row_for(target: str, levels: Any, model: Any, vs: Any, seconds: float) -> dict[str, Any]:
    """One target's numbers as plain JSON."""
    out: dict[str, Any] = {"target": target, "seconds": round(seconds, 1), "seeds": levels.seeds}
    for name, level in (("random", levels.random), ("gold", levels.gold)):
        out[name] = (
            None if level is None else {"rate": level.rate, "ci95": list(level.ci95), "tasks": level.tasks}
        )
    if model is not None:
        out["model"] = {
            "successes": model.successes,
            "n": model.n,
            "rate": model.success_rate,
            "ci95": list(model.ci95),
            "by_task": model.by_task,
        }
    if vs is not None:
        out["model_vs_random"] = {
            "better": vs.better,
            "worse": vs.worse,
            "ties": vs.ties,
            "p_value": vs.p_value,
        }
    return out


def table(rows: list[dict[str, Any]], tasks: int, seeds: int) -> str:
    """The markdown table for RESULTS.md and the README."""
    lines = [
        f"| target | tasks | random valid action ({seeds} seeds/task) | shipped model, greedy | gold path "
        "| model vs random (sign test) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rnd, model, vs = r["random"], r.get("model"), r.get("model_vs_random")
        random_cell = "n/a (no valid actions)" if rnd is None else pct(rnd["rate"], rnd["ci95"])
        model_cell = (
            "—"
            if model is None
            else f"{model['successes']}/{model['n']} = {pct(model['rate'], model['ci95'])}"
        )
        gold_cell = "n/a" if r["gold"] is None else pct(r["gold"]["rate"])
        vs_cell = (
            "—"
            if vs is None
            else f"better on {vs['better']}, worse on {vs['worse']}, p = {vs['p_value']:.2g}"
        )
        lines.append(f"| {r['target']} | {tasks} | {random_cell} | {model_cell} | {gold_cell} | {vs_cell} |")
    return "\n".join(lines)


@dataclass
class Options:
    targets: list[str] = option(TARGETS)
    test: int = option(30, "test tasks per target")
    seeds: int = option(10, "random-policy episodes per task")
    concurrency: int = option(8)
    no_model: bool = option(False, "random and gold only (seconds, no model server)")
    split: str = option("test", "with --no-model: which split", choices=["test", "dev", "train"])
    max_steps: int | None = option(None, "with --no-model: override the step budget")
    out: Path | None = option(None, "JSON file (default bench/results/baseline*.json)")


def run(args: Options) -> None:
    from ratchet.agents.baselines import baselines
    from ratchet.suites import get_suite

    data = fresh_data_dir("ratchet-baseline-")
    rows = []

    def settings_for(target: str) -> Any:
        overrides = {
            "suite": target,
            "splits.test": args.test,
            "concurrency": args.concurrency,
            "evaluate.baseline_seeds": args.seeds,
        }
        return bench_settings(data / target.replace(":", "-"), overrides)

    if args.no_model:
        for target in args.targets:
            started = time.perf_counter()
            suite = get_suite(target)
            levels = baselines(suite, suite.tasks(args.split, args.test), args.seeds, args.max_steps)
            suite.close()
            rows.append(row_for(target, levels, None, None, time.perf_counter() - started))
    else:
        from ratchet.flows.evaluate import evaluate
        from ratchet.flows.launch import run_flow

        with embedded_server(data / "logs") as url:
            for target in args.targets:
                started = time.perf_counter()
                result = run_flow(evaluate, settings_for(target), base_url=url)
                rows.append(
                    row_for(
                        target,
                        result.baselines,
                        result.report,
                        result.vs_random,
                        time.perf_counter() - started,
                    )
                )
                print(f"{target}: {time.perf_counter() - started:.0f} s", flush=True)

    print(table(rows, args.test, args.seeds))
    write_result("baseline_levels" if args.no_model else "baseline", {"rows": rows}, args, path=args.out)
